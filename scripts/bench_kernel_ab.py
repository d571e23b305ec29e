"""Two builds of the CPU kernels, the one-call decode step of each alternated in one
process: a kernel change measured against the revision before it.

    .venv/bin/python scripts/bench_kernel_ab.py --base HEAD~1 --context 300 --rounds 100

``--base``: a git revision whose engine/kernels/*.c are built (for this CPU, privately;
``--level`` a prebuilt level this CPU runs, e.g. ``x86-64-v3`` for the AVX2 code);
the other build is the working tree's. Each loads the default model as served (or
``--model``) with its own kernels and fills the caches of ``--batch`` sequences of
``--context`` tokens; then one decode step of each (the one-call decoder at batch 1)
runs in turn, each first in every other round, ``--rounds`` times: medians in ms, and
new / base. Both builds share the process, the hour and the memory, so the ratio holds
where a machine's speed moves between runs of separate commands by more than the
change. ``--base HEAD`` with a clean tree is the control: two identical builds.
``--amx-rows N`` sets the new build's rule for the quantized Linear's AMX tiles (from N
rows; 0 never, -1 by format as shipped): with ``--base HEAD``, a rule against the
shipped one in the same code. ``--bf16-rows N`` sets the new build's rule for the
quantized Linear on bf16 tiles (from N rows; -1 by format; 0 never, as shipped: not
batch invariant, see ``--no-batch-invariance``); ``--base-bf16-rows N`` the base
build's (a change to the path itself, against HEAD on it). ``--prefill`` times the
forward of each sequence's whole context instead (a prompt's prefill; the caches are
rewritten).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def base_source(revision: str) -> bytes:
    """read_source()'s translation unit, from the kernel files at ``revision``."""
    from engine.kernels import build

    def at_revision(path: Path) -> bytes:
        rel = path.relative_to(REPO_ROOT).as_posix()
        shown = subprocess.run(["git", "-C", str(REPO_ROOT), "show", f"{revision}:{rel}"],
                               capture_output=True)  # fmt: skip
        if shown.returncode:
            raise SystemExit(f"error: cannot read {rel} at {revision!r}: "
                             f"{shown.stderr.decode().strip()}")  # fmt: skip
        return shown.stdout

    return build.read_source(at_revision)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD", help="git revision of the base kernels")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded in each step")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--model", default=None, help="default: the built-in default model")
    parser.add_argument("--quantization", default="auto", choices=("auto", "none", "int8"),
                        help="as serve's (auto: a GGUF's formats as stored)")  # fmt: skip
    parser.add_argument("--amx-rows", type=int, default=None,
                        help="the new build's AMX rule for quantized Linear layers")  # fmt: skip
    parser.add_argument("--bf16-rows", type=int, default=None,
                        help="the new build's bf16-tile rule for quantized layers")  # fmt: skip
    parser.add_argument("--base-bf16-rows", type=int, default=None,
                        help="the base build's bf16-tile rule (where it has the path)")  # fmt: skip
    parser.add_argument("--level", default="native",
                        help="build both for this kernel level (default: this CPU)")  # fmt: skip
    parser.add_argument("--prefill", action="store_true",
                        help="time the prefill of each sequence's --context tokens, not a "
                             "decode step after them")  # fmt: skip
    args = parser.parse_args()
    for flag, rows in (("--bf16-rows", args.bf16_rows), ("--base-bf16-rows", args.base_bf16_rows)):
        if rows is not None and rows < -1:
            parser.error(f"{flag} must be -1 or more, got {rows}")
    if min(args.context, args.rounds, args.batch) < 1:
        parser.error("--context, --rounds and --batch must be at least 1")
    if args.amx_rows is not None and args.amx_rows < -1:
        parser.error(f"--amx-rows must be -1 or more, got {args.amx_rows}")

    from engine.core.model_runner import ModelRunner, SeqInput
    from engine.kernels import build
    from engine.kernels import cpu as cpu_mod
    from engine.kernels import quant as quant_mod
    from engine.kernels.cpu import CpuKernels
    from engine.loader import load_model
    from engine.models import layers as layers_mod

    levels = ["native"] + [
        name for name, _ in build.PREBUILT_LEVELS.get(build.platform.machine(), [])
    ]
    if args.level not in levels:
        parser.error(f"--level must be one of {', '.join(levels)}, got {args.level!r}")
    if args.level != "native" and not build.level_flags(args.level) <= build.cpu_flags():
        parser.error(f"this CPU cannot run {args.level} code")
    print(f"building the kernels at {args.base} and the working tree's ({args.level}) ...",
          file=sys.stderr)  # fmt: skip
    libs = {"base": build.build_source(base_source(args.base), args.level),
            "new": build.build_source(build.read_source(), args.level)}  # fmt: skip
    block = 16
    per = (args.context + block) // block + 1  # cache blocks a sequence
    tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(args.batch)]
    runners = {}
    for name, lib in libs.items():
        kernels = CpuKernels(lib)
        if name == "new" and args.amx_rows is not None:
            quant_mod.QuantOps(kernels.lib).set_amx_min_rows(args.amx_rows)
        bf16_rows = args.bf16_rows if name == "new" else args.base_bf16_rows
        if bf16_rows is not None:
            quant_mod.QuantOps(kernels.lib).set_bf16_min_rows(bf16_rows)
        for module in (cpu_mod, layers_mod, quant_mod):
            module.cpu_kernels = lambda k=kernels: k
        loaded = load_model(
            args.model, dtype=args.dtype, device="cpu", quantization=args.quantization
        )
        runner = ModelRunner(loaded, num_blocks=args.batch * per + 1, block_size=block)
        if args.batch == 1 and runner.model.model.fused is None:
            raise SystemExit(f"error: the {name} kernels give this model no one-call decoder")
        runners[name] = runner
    prompts = [[100 + (i * 7 + j) % 1000 for j in range(args.context + 1)]
               for i in range(args.batch)]  # fmt: skip
    for runner in runners.values():
        for prompt, table in zip(prompts, tables, strict=True):
            runner.forward([SeqInput(prompt[:-1], 0, table, 1)])
    step = [SeqInput(p[:-1], 0, t, 1) if args.prefill else SeqInput(p[-1:], args.context, t, 1)
            for p, t in zip(prompts, tables, strict=True)]  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(args.rounds):
        order = list(runners.items())  # each first in every other round
        for name, runner in order if r % 2 == 0 else order[::-1]:
            prepared = runner.prepare(step)
            start = time.perf_counter()
            runner.execute(prepared)
            times[name].append(time.perf_counter() - start)
        if r % 20 == 19:
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    base, new = (1e3 * statistics.median(times[name]) for name in ("base", "new"))
    what = "prefill of" if args.prefill else "x context"
    print(f"{args.batch} {what} {args.context}: base ({args.base}) {base:.2f} ms, "
          f"new {new:.2f} ms, new / base {new / base:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
