"""A CPU model's weights on 2 MB pages against the same weights on 4 KB pages: the
decode step of each copy alternated in one process.

    .venv/bin/python scripts/bench_weight_hugepages.py --dtype bfloat16 --rounds 300
    .venv/bin/python scripts/bench_weight_hugepages.py --dtype float32 --level x86-64-v3

Loads the default model as served (or ``--model``) once for each letter of ``--order``
(``on``: ``weights_on_huge_pages`` moves its large weights onto 2 MB pages, as loading
does by default; ``off``: ``SPECSERVE_WEIGHT_HUGEPAGES=0``, where loading left them),
fills each copy's caches with ``--batch`` sequences of ``--context`` tokens, then
times one decode step of each copy in turn, ``--rounds`` times (the order reversed
every other round). Prints each copy's median and on / off, the mean of the ``on``
copies' medians over the ``off`` ones'. Copies are interleaved (the default
off,on,off,on) because the first model a process loads measured up to 5% slower than
the ones after it on 4 KB pages (a Zen 4, 2026-12-07): the pages each copy got, not
the order, is what the ratio should show. ``AnonHugePages`` of the process is printed:
0 kB means Linux took no advice (transparent huge pages ``never``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--model", default=None, help="default: the built-in default model")
    parser.add_argument("--quantization", default="auto", choices=("auto", "none", "int8"))
    parser.add_argument("--level", default="native",
                        help="a prebuilt kernel level this CPU runs (x86-64-v3 ..)")  # fmt: skip
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--order", default="off,on,off,on",
                        help="the copies to load, in order: on or off each")  # fmt: skip
    args = parser.parse_args()
    order = args.order.split(",")
    if not order or any(o not in ("on", "off") for o in order) or len(set(order)) != 2:
        parser.error(f"--order must list on and off (each at least once), got {args.order!r}")
    if min(args.batch, args.context, args.rounds) < 1:
        parser.error("--batch, --context and --rounds must be at least 1")

    from engine import envs
    from engine.core.model_runner import ModelRunner, SeqInput
    from engine.kernels import build
    from engine.kernels import cpu as cpu_mod
    from engine.kernels import quant as quant_mod
    from engine.kernels.cpu import CpuKernels
    from engine.loader import load_model
    from engine.models import layers as layers_mod

    if args.level != "native":
        reason = build.level_unrunnable(args.level)
        if reason is not None:
            parser.error(f"--level {args.level!r}: {reason}")
        print(f"building the {args.level} kernels ...", file=sys.stderr, flush=True)
        out = Path(tempfile.mkdtemp(prefix="specserve-levels-"))
        kernels = CpuKernels(build.prebuild(out, only=[args.level])[0])
        for module in (cpu_mod, layers_mod, quant_mod):
            module.cpu_kernels = lambda k=kernels: k
    block = 16
    per = (args.context + block) // block + 1  # cache blocks a sequence
    tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(args.batch)]
    prompts = [[100 + (i * 7 + j) % 1000 for j in range(args.context + 1)]
               for i in range(args.batch)]  # fmt: skip
    runners = []
    for i, pages in enumerate(order):
        print(f"loading copy {i + 1}/{len(order)} ({pages}) ...", file=sys.stderr, flush=True)
        with envs.overridden("SPECSERVE_WEIGHT_HUGEPAGES", "1" if pages == "on" else "0"):
            loaded = load_model(
                args.model, dtype=args.dtype, device="cpu", quantization=args.quantization
            )
        runner = ModelRunner(loaded, num_blocks=args.batch * per + 1, block_size=block)
        for prompt, table in zip(prompts, tables, strict=True):
            runner.forward([SeqInput(prompt[:-1], 0, table, 1)])
        runners.append(runner)
    step = [SeqInput(p[-1:], args.context, t, 1) for p, t in zip(prompts, tables, strict=True)]
    times: list[list[float]] = [[] for _ in runners]
    for r in range(args.rounds):
        turn = range(len(runners)) if r % 2 == 0 else reversed(range(len(runners)))
        for i in turn:
            prepared = runners[i].prepare(step)
            start = time.perf_counter()
            runners[i].execute(prepared)
            times[i].append(time.perf_counter() - start)
        if r % 50 == 49:
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    medians = [1e3 * statistics.median(t) for t in times]
    rollup = Path("/proc/self/smaps_rollup")
    lines = rollup.read_text().splitlines() if rollup.exists() else []
    huge = next((line.split()[1] for line in lines if line.startswith("AnonHugePages")), "?")
    copies = ", ".join(f"{p} {m:.2f} ms" for p, m in zip(order, medians, strict=True))
    on, off = (statistics.mean(m for p, m in zip(order, medians, strict=True) if p == want)
               for want in ("on", "off"))  # fmt: skip
    print(f"{args.level} {args.dtype}, {args.batch} x context {args.context}: {copies}; "
          f"on / off {on / off:.3f} (AnonHugePages {huge} kB)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
