"""Where speculation's time goes at batch 1: the target's step by width, the draft's burst.

    .venv/bin/python scripts/bench_eagle_costs.py --rounds 3   # the shipped EAGLE draft

Runs held-out chat prompts one at a time through the default model (bf16, dequantized,
as the draft tables are measured) with no speculation and with the EAGLE draft at a fixed
k of 1, 2 and 4, and prints the median over rounds of: the target forward by the number
of tokens it verifies (1 = plain decode), the draft's time per burst step, and the share
of drafts kept at each position. With these, one verification of k drafts yields
1 + sum of kept drafts tokens and costs target(k + 1) + k * draft_step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--eagle-draft", default=None, help="default: the shipped EAGLE draft")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()

    from engine.benchmarks.offline import tokenize_prompts
    from engine.benchmarks.workloads import load_prompts
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.default_model import default_draft_path

    draft = args.eagle_draft or str(default_draft_path(eagle=True))
    base = dict(quantization="none", dtype="bfloat16")
    plain = LLMEngine(EngineConfig(speculative_method="none", **base))
    prompts = tokenize_prompts(plain.tokenizer, load_prompts("chat", args.num_prompts), True)
    eagle = LLMEngine(
        EngineConfig(speculative_method="eagle", draft_model=draft, **base), loaded=plain.loaded
    )
    widths: dict[int, list[float]] = {}
    bursts: dict[int, list[float]] = {}
    kept: dict[int, list[float]] = {}
    for _ in range(args.rounds):
        for k, engine in ((0, plain), (1, eagle), (2, eagle), (4, eagle)):
            forward, burst, by_position = _run(engine, prompts, k, args.output_len)
            for width, seconds in forward.items():
                widths.setdefault(width, []).append(seconds)
            if k:
                bursts.setdefault(k, []).append(burst)
            if k == 4:
                for position, share in enumerate(by_position):
                    kept.setdefault(position, []).append(share)
    one = statistics.median(widths[1])
    print("target forward by verified tokens (ms, and relative to a plain decode step):")
    for width in sorted(widths):
        ms = statistics.median(widths[width])
        print(f"  {width} token(s): {ms * 1e3:.1f} ms  {ms / one:.2f}x")
    print("EAGLE draft, per burst step:")
    for k in sorted(bursts):
        ms = statistics.median(bursts[k])
        print(f"  k={k}: {ms * 1e3:.2f} ms  {ms / one:.3f} of a plain step")
    shares = " / ".join(f"{statistics.median(kept[p]):.2f}" for p in sorted(kept))
    print(f"drafts kept at positions 1..4 (k=4, among verifications reaching them): {shares}")
    return 0


def _run(engine, prompts, k: int, output_len: int):
    """(median target forward seconds by width, median draft seconds per burst step,
    kept share by draft position) for prompts run one at a time at a fixed k."""
    from engine.benchmarks.offline import spec_stats
    from engine.io.sampling_params import SamplingParams

    forward: dict[int, list[float]] = {}
    execute = engine.runner.execute

    def timed_execute(prepared):
        start = time.perf_counter()
        out = execute(prepared)
        if prepared.metadata.max_query_len <= 1 + k:  # decode / verification, not prefill
            width = prepared.metadata.num_tokens
            forward.setdefault(width, []).append(time.perf_counter() - start)
        return out

    burst: list[float] = []
    proposer = engine.proposer
    propose = proposer.propose if proposer is not None else None

    def timed_propose(items, states):
        start = time.perf_counter()
        out = propose(items, states)
        burst.append((time.perf_counter() - start) / max(1, k))
        return out

    engine.runner.execute = timed_execute
    if proposer is not None:
        proposer.propose = timed_propose
    params = SamplingParams(
        max_tokens=output_len,
        temperature=0.0,
        ignore_eos=True,
        num_speculative_tokens=k if proposer is not None else None,
    )
    steps = []
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"k{k}-{i}-{time.monotonic_ns()}", prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
                if engine.last_step is not None:
                    steps.append(engine.last_step)
    finally:
        engine.runner.execute = execute
        if proposer is not None:
            proposer.propose = propose
    medians = {w: statistics.median(s) for w, s in forward.items() if len(s) >= 3}
    shares = spec_stats(steps).get("acceptance_by_position", [])
    return medians, statistics.median(burst) if burst else 0.0, shares


if __name__ == "__main__":
    sys.exit(main())
