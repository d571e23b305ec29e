"""What sending every query through the attention kernel costs at prefill.

The cpu attention backend computes every query row with the compiled kernel
(engine/attention/cpu_backend.py says why); before, long prefill chunks went to SDPA
(in float32 until 2026-12-04). This times one prompt's prefill (LLM.generate with
max_tokens=1, prefix caching off) on the default model both ways, three runs each, and
prints the medians:

    .venv/bin/python scripts/bench_bf16_prefill.py [--lengths 128,512,2048] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import engine.attention.cpu_backend as cpu_backend
from engine.entrypoints.llm import LLM
from engine.io.sampling_params import SamplingParams


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="128,512,2048", help="prompt lengths in tokens")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    kernel_plan = cpu_backend._make_plan

    def sdpa_plan(metadata, dtype):  # the old float32 rule: chunks over 16 tokens on SDPA
        return cpu_backend.split_plan(metadata, cpu_backend.SHORT_QUERY_MAX)

    llm = LLM(
        dtype=args.dtype,
        device="cpu",
        speculative_method="none",
        enable_prefix_caching=False,
        quantization="none",  # the dequantized weights, as the documented rows were measured
    )
    text = "The quick brown fox jumps over the lazy dog. " * 1000
    ids = llm.tokenizer.encode(text)
    for n in (int(x) for x in args.lengths.split(",")):
        for name, plan in (("kernel", kernel_plan), ("sdpa", sdpa_plan)):
            cpu_backend._make_plan = plan
            times = []
            for _ in range(args.runs):
                start = time.perf_counter()
                llm.generate([ids[:n]], SamplingParams(max_tokens=1, temperature=0))
                times.append(time.perf_counter() - start)
            print(
                f"{n:5d} tokens  {name:6s}  {statistics.median(times) * 1000:7.0f} ms", flush=True
            )
    cpu_backend._make_plan = kernel_plan
    return 0


if __name__ == "__main__":
    sys.exit(main())
