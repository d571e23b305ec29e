"""The quantized Linear on AMX tiles against vpdpbusd, one layer alone.

    .venv/bin/python scripts/bench_amx.py --rounds 3
    .venv/bin/python scripts/bench_amx.py --rounds 3 --base HEAD~1
    .venv/bin/python scripts/bench_amx.py --rounds 5 --rows 8,16,32,64,512 --bf16

For Q4_1 and Q8_0 weights of the default model's shapes ([1536, 576] as gate_up and
[576, 1536] as down, random quants) and bf16 activations of m rows, the median time of
a call with the AMX path off and forced on (every row block on tiles), alternated call
by call, and the multiply-adds per second of the faster. ``--base REV`` also builds the
kernels at a git revision and times its AMX path in the same rounds (a change to the
tile path against the one before it, in one process and hour). ``--bf16`` also times
the path ``--no-batch-invariance`` turns on (weights dequantized to bf16 on AMX-BF16
tiles, every call on it), against the faster of the two int8 paths. Checks on the way
that every int8 path gives the same bits (the bf16 one has its own, checked by
tests/engine/test_quant_kernels.py). On a CPU or build without AMX it says so and stops.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

GGUF_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default="1,3,5,9,16,32,64,128")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--shapes", default="1536x576,576x1536", help="[n, k] of each layer")
    parser.add_argument("--base", default=None, help="git revision whose AMX path to time too")
    parser.add_argument("--bf16", action="store_true", help="time the bf16-tile path too")
    args = parser.parse_args()
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error("--shapes is NxK[,NxK...] and --rows a list of integers")
    if min(args.rounds, args.calls, *rows) < 1 or any(k % 32 or n < 1 for n, k in shapes):
        parser.error("--rounds, --calls and --rows must be at least 1, each k a multiple of 32")

    import torch

    from engine.kernels.quant import FORMATS, QuantOps, quant_ops

    ops = quant_ops()
    if ops is None or ops.amx_min_rows == 0:
        print("this build of the kernels has no AMX path (a CPU without AMX-INT8)")
        return 1
    if args.bf16 and not ops.bf16_tiles:
        print("this build of the kernels has no bf16-tile path (a CPU without AMX-BF16)")
        return 1
    base = None
    if args.base is not None:
        from bench_kernel_ab import base_source

        from engine.kernels import build
        from engine.kernels.cpu import CpuKernels

        print(f"building the kernels at {args.base} ...", file=sys.stderr, flush=True)
        base = QuantOps(CpuKernels(build.build_source(base_source(args.base))).lib)
    torch.manual_seed(0)
    columns = ("| format | [n, k] | rows | vpdpbusd us | AMX us | AMX vs vpdpbusd "
               "| GMAC/s (faster) |")  # fmt: skip
    if base is not None:
        columns += f" AMX at {args.base} us | this / {args.base} |"
    if args.bf16:
        columns += " bf16 tiles us | bf16 vs the faster |"
    if args.bf16 and base is not None:
        columns += f" bf16 at {args.base} us | this / {args.base} |"
    print(columns)
    print("|---" * (columns.count("|") - 1) + "|")
    for name in ("Q4_1", "Q8_0"):
        for n, k in shapes:
            rows_gguf = _random_rows(torch, name, n, k)
            weight = ops.pack(FORMATS[name], rows_gguf, k)
            base_weight = None if base is None else base.pack(FORMATS[name], rows_gguf, k)
            for m in rows:
                x = torch.randn(m, k).to(torch.bfloat16)
                # (ops, weight, rule): vpdpbusd, AMX, and the base revision's AMX
                runs = {"off": (ops, weight, 0), "amx": (ops, weight, 1)}
                if base is not None:
                    runs["base"] = (base, base_weight, 1)
                if args.bf16:
                    runs["bf16"] = (ops, weight, 0)
                if args.bf16 and base is not None:
                    runs["base_bf16"] = (base, base_weight, 0)
                times = {key: [] for key in runs}
                outs = {}
                for _ in range(args.rounds):
                    for key, (o, w, rule) in runs.items():
                        o.set_amx_min_rows(rule)
                        if args.bf16:
                            ops.set_bf16_min_rows(1 if key == "bf16" else 0)
                        if "base_bf16" in runs:
                            base.set_bf16_min_rows(1 if key == "base_bf16" else 0)
                        outs[key] = o.linear(x, w, None)
                        start = time.perf_counter()
                        for _ in range(args.calls):
                            o.linear(x, w, None)
                        times[key].append((time.perf_counter() - start) / args.calls)
                bf16_out, base_bf16_out = outs.pop("bf16", None), outs.pop("base_bf16", None)
                if base_bf16_out is not None and not torch.equal(bf16_out, base_bf16_out):
                    print(f"{name} m={m}: bf16 tiles give other bits than at {args.base}",
                          file=sys.stderr)  # fmt: skip
                if any(not torch.equal(outs["off"], out) for out in outs.values()):
                    print(f"{name} m={m}: the paths differ", file=sys.stderr)
                    return 2
                us = {key: 1e6 * statistics.median(t) for key, t in times.items()}
                gmacs = m * n * k / min(us["off"], us["amx"]) / 1e3
                line = (f"| {name} | [{n}, {k}] | {m} | {us['off']:.1f} | {us['amx']:.1f} | "
                        f"{us['off'] / us['amx']:.2f}x | {gmacs:.0f} |")  # fmt: skip
                if base is not None:
                    line += f" {us['base']:.1f} | {us['amx'] / us['base']:.3f} |"
                if args.bf16:
                    line += f" {us['bf16']:.1f} | {min(us['off'], us['amx']) / us['bf16']:.2f}x |"
                if "base_bf16" in us:
                    line += f" {us['base_bf16']:.1f} | {us['bf16'] / us['base_bf16']:.3f} |"
                print(line, flush=True)
    ops.set_amx_min_rows(-1)
    ops.set_bf16_min_rows(0)
    if base is not None:
        base.set_amx_min_rows(-1)
    return 0


def _random_rows(torch, name: str, n: int, k: int):
    """GGUF rows of random quants with small, finite fp16 scales (and minimums)."""
    nb, size = k // 32, GGUF_BLOCK_BYTES[name]
    rows = torch.randint(0, 256, (n, nb * size), dtype=torch.uint8)
    blocks = rows.view(n, nb, size)
    blocks[:, :, 0:2] = (torch.rand(n, nb) * 0.01 + 1e-3).half().view(torch.uint8).view(n, nb, 2)
    if name == "Q4_1":
        minimum = (torch.rand(n, nb) * 0.01 - 5e-3).half().view(torch.uint8).view(n, nb, 2)
        blocks[:, :, 2:4] = minimum
    return rows


if __name__ == "__main__":
    sys.exit(main())
