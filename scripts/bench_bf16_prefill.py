"""What sending every bf16 query through the attention kernel costs at prefill.

In bfloat16 the cpu attention backend computes every query row with the compiled kernel
(engine/attention/cpu_backend.py says why); in float32 long prefill chunks go to SDPA.
This times one prompt's prefill (LLM.generate with max_tokens=1, prefix caching off) on
the default model in bf16 both ways, three runs each, and prints the medians:

    .venv/bin/python scripts/bench_bf16_prefill.py [--lengths 128,512,2048]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import engine.attention.cpu_backend as cpu_backend
from engine.entrypoints.llm import LLM
from engine.io.sampling_params import SamplingParams


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="128,512,2048", help="prompt lengths in tokens")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    kernel_plan = cpu_backend._make_plan

    def sdpa_plan(metadata, dtype):  # float32's rule: chunks over 16 tokens go to SDPA
        return kernel_plan(metadata, torch.float32)

    llm = LLM(
        dtype="bfloat16",
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
