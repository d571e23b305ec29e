"""The quantized Linear alone, its weights streamed from memory: builds side by side.

    .venv/bin/python scripts/bench_quant_stream.py --base HEAD~1
    .venv/bin/python scripts/bench_quant_stream.py --levels native,x86-64-v3 --rows 1,4,32
    .venv/bin/python scripts/bench_quant_stream.py --levels x86-64-v3 --base HEAD --layers 1

A decode step reads each weight once, from memory: a layer timed alone over and over
reads it from cache instead and says little about the step. Here ``--layers`` copies of
a random Q4_1 (or ``--format``) weight of the default model's gate_up shape ([1536,
576]) are packed by each build, laid on 2 MB pages (as loading lays a model's weights)
and called in turn with bf16 activations of m rows (``--rows``), so every call streams
its weight; ``--layers 1`` times it from cache. The builds are ``--levels`` (``native``
and the prebuilt levels this CPU runs) and, with ``--base REV``, the kernels at a git
revision built for each of those levels too (``REV`` for native, ``LEVEL REV`` for a
level), beside the working tree's. Each round times one pass over
the layers of every build, the build that goes first turning round by round; printed:
the median microseconds a call, the weight bytes streamed a second, each build's ratio
to the first's, and the machine's read bound measured after. Every build's outputs are
checked to be the same bits as the first's (the int8 paths are batch invariant).
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
    parser.add_argument("--levels", default="native", help="native and/or prebuilt levels")
    parser.add_argument("--base", default=None, help="also the working tree against REV")
    parser.add_argument("--rows", default="1,2,4,6,8,32")
    parser.add_argument("--format", default="Q4_1", choices=("Q4_1", "Q8_0"))
    parser.add_argument("--shape", default="1536x576", help="[n, k] of the weight")
    parser.add_argument("--layers", type=int, default=96, help="copies of the weight cycled")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="default: torch's")
    args = parser.parse_args()
    try:
        rows = [int(r) for r in args.rows.split(",")]
        n, k = (int(v) for v in args.shape.lower().split("x"))
    except ValueError:
        parser.error(f"--rows takes integers and --shape NxK, got {args.rows!r}, {args.shape!r}")
    if min(rows) < 1:
        parser.error(f"--rows must each be at least 1, got {args.rows!r}")
    if n < 1 or k < 32 or k % 32:
        parser.error(f"--shape must be NxK with n >= 1 and k a multiple of 32, got {args.shape!r}")
    for name in ("layers", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.threads < 0:
        parser.error(f"--threads must be 0 (torch's) or more, got {args.threads}")

    import torch
    from bench_amx import _random_rows

    from engine.attention import advise_huge_pages
    from engine.benchmarks import bounds
    from engine.kernels import build
    from engine.kernels.cpu import CpuKernels, cpu_kernels
    from engine.kernels.quant import FORMATS, QuantOps, QuantWeight
    from engine.models.weights import huge_page_arena

    levels = [level.strip() for level in args.levels.split(",") if level.strip()]
    for level in levels:
        reason = build.level_unrunnable(level)
        if reason is not None:
            parser.error(f"--levels {args.levels!r}: {reason}")
    if args.threads:
        torch.set_num_threads(args.threads)
    native = cpu_kernels()
    if native is None:
        print("error: the CPU kernels are off or failed to build", file=sys.stderr)
        return 1
    libs: dict[str, CpuKernels] = {}
    if any(level != "native" for level in levels):
        print("building the prebuilt kernel levels asked for (under a minute) ...", file=sys.stderr)
        built = build.prebuild_levels(Path(tempfile.mkdtemp()), levels)
    for level in levels:
        libs[level] = native if level == "native" else CpuKernels(built[level])
    if args.base is not None:
        from bench_kernel_ab import base_source

        source = base_source(args.base)
        for level in levels:
            name = args.base if level == "native" else f"{level} {args.base}"
            print(f"building the kernels at {args.base} for {level} ...", file=sys.stderr,
                  flush=True)  # fmt: skip
            libs[name] = CpuKernels(build.build_source(source, level))

    fmt = FORMATS[args.format]
    torch.manual_seed(0)
    sources = [_random_rows(torch, args.format, n, k) for _ in range(args.layers)]
    setups = {}  # name: (ops, weights on 2 MB pages, bytes a weight)
    for name, kernels in libs.items():
        ops = QuantOps(kernels.lib)
        packed = [ops.pack(fmt, rows_gguf, k) for rows_gguf in sources]
        size = packed[0].data.numel()
        step = -(-size // 4096) * 4096
        arena = huge_page_arena(step * args.layers)
        advise_huge_pages(arena)
        weights = []
        for i, w in enumerate(packed):
            weights.append(QuantWeight(arena[i * step : i * step + size].copy_(w.data), fmt, n, k))
        setups[name] = (ops, weights, size)
        del packed
    names = list(setups)
    columns = [f"{name} us" for name in names] + [f"{name} GB/s" for name in names]
    columns += [f"{name} / {names[0]}" for name in names[1:]]
    print(f"| rows | {' | '.join(columns)} |")
    print("|---" * (1 + len(columns)) + "|")
    for m in rows:
        x = torch.randn(m, k).to(torch.bfloat16)
        outs = {name: ops.linear(x, weights[0], None) for name, (ops, weights, _) in setups.items()}
        first = outs[names[0]]
        for name, out in outs.items():
            if not torch.equal(out, first):
                print(f"error: {name} gives other bits than {names[0]} at {m} rows",
                      file=sys.stderr)  # fmt: skip
                return 2
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.rounds):
            turn = r % len(names)
            for name in names[turn:] + names[:turn]:
                ops, weights, _ = setups[name]
                start = time.perf_counter()
                for w in weights:
                    ops.linear(x, w, None)
                times[name].append((time.perf_counter() - start) / len(weights))
        us = {name: 1e6 * statistics.median(t) for name, t in times.items()}
        gbps = {name: setups[name][2] / us[name] / 1e3 for name in names}
        cells = [f"{us[name]:.1f}" for name in names] + [f"{gbps[name]:.3g}" for name in names]
        cells += [f"{us[name] / us[names[0]]:.3f}" for name in names[1:]]
        print(f"| {m} | {' | '.join(cells)} |", flush=True)
    machine = bounds.measure()
    print(f"read bound after the runs: {machine.read_gbps:.1f} GB/s "
          f"({args.format} [{n}, {k}], {args.layers} weights of {setups[names[0]][2] / 1e3:.1f} "
          f"KB each, {torch.get_num_threads()} threads)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
