"""Regenerate the Python stubs in engine/rpc/ from proto/specserve/v1/*.proto.

    python -m engine.rpc.regen            # rewrite the committed stubs
    python -m engine.rpc.regen --out DIR  # write them somewhere else (the drift test)

protoc names the grpc module's import after the .proto path (``from specserve.v1
import generation_pb2``); we flatten the stubs into ``engine.rpc`` and rewrite that
import, because a top-level ``specserve``/``proto`` package would collide with others.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "proto"
RPC_DIR = Path(__file__).resolve().parent
PROTO_FILES = ("specserve/v1/generation.proto",)


def generate(out_dir: Path) -> list[Path]:
    """Compile every .proto into ``out_dir``; return the files written."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{_well_known_protos()}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            *PROTO_FILES,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        for proto in PROTO_FILES:
            stem = Path(proto).stem
            package = ".".join(Path(proto).parent.parts)
            for suffix in ("_pb2.py", "_pb2_grpc.py"):
                text = (Path(tmp) / Path(proto).parent / f"{stem}{suffix}").read_text()
                text = re.sub(
                    rf"^from {re.escape(package)} import ",
                    "from engine.rpc import ",
                    text,
                    flags=re.MULTILINE,
                )
                target = out_dir / f"{stem}{suffix}"
                target.write_text(text)
                written.append(target)
    return written


def _well_known_protos() -> str:
    import grpc_tools

    return str(Path(grpc_tools.__file__).parent / "_proto")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RPC_DIR, help="output directory")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
