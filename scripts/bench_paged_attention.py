"""The CPU paged-attention kernel alone, one decode step's call for one layer.

    .venv/bin/python scripts/bench_paged_attention.py --seqs 8,32 --context 150 [--dtype float32]

The default model's attention shape (9 query heads, 3 KV heads, head size 64, bf16 or
`--dtype float32`, 16-token blocks): `--seqs` sequences of `--context` tokens each
decode one token, their cache blocks scattered through the cache in random order.
Prints per sequence count the median time of a call (the Python wrapper's ~12 us
included: one sequence shows it), that x 30 layers, the multiply-adds per second (Q.K
and P.V) and the KV bytes read per second.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", default="8,32")
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()

    import torch

    from engine.kernels.cpu import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        print("no compiled CPU kernels on this machine", file=sys.stderr)
        return 1
    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    ctx = args.context
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    for seqs in (int(s) for s in args.seqs.split(",")):
        per = ctx // block + 2
        k_cache = torch.randn(seqs * per + 1, block, kv_heads, head_dim).to(dtype)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(seqs, heads, head_dim).to(dtype)
        out = torch.empty_like(q)
        tables = (torch.randperm(seqs * per) + 1).to(torch.int32).view(seqs, per)
        lens = torch.full((seqs,), ctx, dtype=torch.int32)
        starts = torch.arange(seqs + 1, dtype=torch.int32)
        ids = torch.arange(seqs, dtype=torch.int32)
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(30):
                kernels.paged_attention(out, q, k_cache, v_cache, tables, lens, starts, ids, 1,
                                        head_dim**-0.5)  # fmt: skip
            times.append((time.perf_counter() - start) / 30)
        t = statistics.median(times)
        macs = seqs * heads * ctx * head_dim * 2
        kv_bytes = seqs * ctx * kv_heads * head_dim * 2 * dtype.itemsize
        print(f"{seqs} sequences x {ctx} tokens: {t * 1e6:.0f} us a call, {t * 30e3:.2f} ms "
              f"for 30 layers; {macs / t / 1e9:.1f} G multiply-adds/s; KV {kv_bytes / 1e6:.1f} "
              f"MB at {kv_bytes / t / 1e9:.1f} GB/s", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
