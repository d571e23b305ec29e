"""The quantized Linear on AMX tiles against vpdpbusd, one layer alone.

    .venv/bin/python scripts/bench_amx.py --rounds 3

For Q4_1 and Q8_0 weights of the default model's MLP shape ([1536, 576], random
quants) and bf16 activations of m rows, the median time of a call with the AMX path
off and forced on (every row block on tiles), alternated call by call, and the
multiply-adds per second of the faster. Checks on the way that both paths give the
same bits. On a CPU or build without AMX it says so and stops.
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
    args = parser.parse_args()

    import torch

    from engine.kernels.quant import FORMATS, quant_ops

    ops = quant_ops()
    if ops is None or ops.amx_min_rows == 0:
        print("this build of the kernels has no AMX path (a CPU without AMX-INT8)")
        return 1
    torch.manual_seed(0)
    n, k = 1536, 576
    print("| format | rows | vpdpbusd us | AMX us | AMX vs vpdpbusd | GMAC/s (faster) |")
    print("|---|---|---|---|---|---|")
    for name in ("Q4_1", "Q8_0"):
        weight = ops.pack(FORMATS[name], _random_rows(torch, name, n, k), k)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k).to(torch.bfloat16)
            times = {0: [], 1: []}
            outs = {}
            for _ in range(args.rounds):
                for rule in (0, 1):
                    ops.set_amx_min_rows(rule)
                    outs[rule] = ops.linear(x, weight, None)
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        ops.linear(x, weight, None)
                    times[rule].append((time.perf_counter() - start) / args.calls)
            if not torch.equal(outs[0], outs[1]):
                print(f"{name} m={m}: the two paths differ", file=sys.stderr)
                return 2
            plain, amx = (1e6 * statistics.median(times[r]) for r in (0, 1))
            gmacs = m * n * k / min(plain, amx) / 1e3
            print(f"| {name} | {m} | {plain:.1f} | {amx:.1f} | {plain / amx:.2f}x | {gmacs:.0f} |",
                  flush=True)  # fmt: skip
    ops.set_amx_min_rows(-1)
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
