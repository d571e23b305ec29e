"""specserve's bf16 Linear kernels side by side in one process, on the default model's
Linear shapes, against oneDNN's bf16 GEMM (torch's ``F.linear``).

    .venv/bin/python scripts/bench_bf16_linear.py [--rows 1,8,32,128] [--kernels amx,fma]

Per shape and row count, the best of 3 timed loops of each bf16 Linear kernel this
build has (``amx``: tdpbf16ps on AMX tiles, ``vdpbf16ps``, ``fma``: widened to fp32),
switched in turn on the same packed weights, and of oneDNN; ms and G multiply-adds/s
each, then the totals of one decode step's Linear layers (30 layers + the 49k-row
head). The machine's bounds are printed first. The weights are random and the loops
repeat them, so a shape smaller than the last-level cache is timed partly from it:
whole-run numbers are ``specserve bench offline``'s.
"""

from __future__ import annotations

import argparse
import sys

# the same shapes and timing loop as the float32 kernel's benchmark (run from scripts/,
# which Python puts first on the path)
from bench_f32_linear import LAYERS, SHAPES, _best_ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,8,32,128")
    parser.add_argument("--kernels", default=None, help="comma-separated (default: all here)")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from engine.benchmarks import bounds as bounds_mod
    from engine.kernels.cpu import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None or not kernels.bf16_linear_modes:
        print("error: no bf16 Linear kernel here (needs a CPU with FMA)", file=sys.stderr)
        return 1
    names = args.kernels.split(",") if args.kernels else list(kernels.bf16_linear_modes)
    missing = [n for n in names if n not in kernels.bf16_linear_modes]
    if missing:
        print(f"error: no {', '.join(missing)} kernel here; this build has: "
              f"{', '.join(kernels.bf16_linear_modes)}", file=sys.stderr)  # fmt: skip
        return 2
    bound = bounds_mod.measure()
    print(bound.line() if bound is not None else "machine bounds: n/a (no kernels)")
    print(f"kernels: {kernels.path.name}; picked at start: {kernels.bf16_linear}")
    print("| rows | shape | " + " | ".join(f"{n} ms (G/s)" for n in [*names, "oneDNN"]) + " |")
    print("|---" * (len(names) + 3) + "|")
    before = kernels.bf16_linear
    try:
        for rows in (int(r) for r in args.rows.split(",")):
            step = dict.fromkeys([*names, "oneDNN"], 0.0)
            for n, k in SHAPES:
                weight = (torch.randn(n, k) / k**0.5).to(torch.bfloat16)
                x = torch.randn(rows, k).to(torch.bfloat16)
                packed = kernels.pack_linear_weight(weight)
                reps = max(3, int(2e8 / (n * k * max(rows, 8))))
                times = {}
                for name in names:
                    kernels.set_bf16_linear(name)
                    times[name] = _best_ms(kernels.linear, (x, packed, None, n), reps)
                times["oneDNN"] = _best_ms(F.linear, (x, weight), reps)
                cells = []
                for name, ms in times.items():
                    cells.append(f"{ms:.3f} ({rows * n * k / ms / 1e6:.0f})")
                    step[name] += ms * (1 if n == SHAPES[-1][0] else LAYERS)
                print(f"| {rows} | [{n}, {k}] | " + " | ".join(cells) + " |", flush=True)
            print(f"| {rows} | one step | " + " | ".join(f"{ms:.2f}" for ms in step.values())
                  + " |", flush=True)  # fmt: skip
    finally:
        if before is not None:
            kernels.set_bf16_linear(before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
