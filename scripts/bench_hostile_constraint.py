"""What a hostile constraint costs the free requests beside it (docs/benchmarks.md,
"A failing constraint beside free requests").

    .venv/bin/python scripts/bench_hostile_constraint.py --rounds 5

The default model and configuration, in one process. Each round runs four modes in
turn: three free chat requests alone (greedy, --output-len tokens each); the same three
beside a request whose grammar makes every mask cost more than the one before
(temperature 1, min_tokens = max_tokens, so EOS cannot end it), with a 5 ms step budget
and with the default 20 ms; and the same with the budget out of reach (what the engine
did before it had one: the request runs to max_tokens). Prints the free requests' time
per output token (TPOT, first token to last) per mode, the median (range) of the
per-round ratios against alone, and where the hostile request ended.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

from engine.benchmarks import bounds
from engine.benchmarks.workloads import CHAT_PROMPTS
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.io.sampling_params import SamplingParams, StructuredOutput
from engine.loader import load_model

# Twelve alternatives for the same space-separated words: on the default model's
# vocabulary the parser's work per token grows with the output (a mask costs ~8 ms after
# 25 tokens, ~200 ms after 100, ~370 ms after 125) and no llguidance limit stops it first.
SLOW = (
    "start: s\ns: "
    + " | ".join(f"s{i}" for i in range(12))
    + "\n"
    + "".join(f's{i}: s " " s | /[a-z]+/\n' for i in range(12))
)


def _run(engine: LLMEngine, prompts: list[str], output_len: int, hostile: bool):
    """(mean TPOT of the free requests in s, the hostile request's (tokens, reason))."""
    free = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"free{i}", None, free, messages=[{"role": "user", "content": prompt}])
    if hostile:
        params = SamplingParams(
            max_tokens=output_len,
            min_tokens=output_len,
            temperature=1.0,
            seed=0,
            structured_output=StructuredOutput(grammar=SLOW),
        )
        engine.add_request("hostile", "Words:", params)
    first, last, counts, end = {}, {}, {}, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            counts[out.request_id] = counts.get(out.request_id, 0) + len(out.token_ids)
            if out.request_id == "hostile":
                if out.finished:
                    end = (counts["hostile"], out.finish_reason)
                continue
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
    tpots = [(last[r] - first[r]) / (counts[r] - 1) for r in first]
    return statistics.mean(tpots), end


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    if args.rounds < 1 or args.output_len < 8:
        parser.error("--rounds must be >= 1 and --output-len >= 8")
    config = EngineConfig()
    print("loading the default model ...", file=sys.stderr, flush=True)
    loaded = load_model(
        config.model, dtype=config.dtype, device=config.device,
        attn_backend=config.attn_backend, tokenizer=None, quantization=config.quantization,
    )  # fmt: skip
    modes = {
        "alone": (config, False),
        "beside, 5 ms budget": (replace(config, structured_output_step_budget_ms=5.0), True),
        "beside, 20 ms budget (the default)": (config, True),
        "beside, no budget": (replace(config, structured_output_step_budget_ms=6e4), True),
    }
    engines = {name: LLMEngine(c, loaded=loaded) for name, (c, _) in modes.items()}
    prompts = CHAT_PROMPTS[:3]
    tpot: dict[str, list[float]] = {name: [] for name in modes}
    ends: dict[str, list] = {name: [] for name in modes}
    for r in range(args.rounds):
        for name, (_, hostile) in modes.items():
            print(f"[round {r + 1}/{args.rounds}] {name}", file=sys.stderr, flush=True)
            seconds, end = _run(engines[name], prompts, args.output_len, hostile)
            tpot[name].append(seconds)
            ends[name].append(end)
    print(bounds.line())
    print(f"\nfree requests' TPOT, {args.rounds} rounds, {len(prompts)} free requests, "
          f"{args.output_len} tokens each\n")  # fmt: skip
    print("| mode | TPOT ms | vs alone | the hostile request ended |")
    print("|---|---|---|---|")
    for name in modes:
        ms = [1e3 * t for t in tpot[name]]
        ratios = [t / a for t, a in zip(tpot[name], tpot["alone"])]
        print(f"| {name} | {_mr(ms, '.2f')} | {_mr(ratios, '.2f')}x | {_ended(ends[name])} |")
    return 0


def _ended(ends: list) -> str:
    if ends[0] is None:
        return "-"
    counts = [n for n, _ in ends]
    reasons = ", ".join(sorted({why for _, why in ends}))
    return f"after {_mr(counts, 'd')} tokens: {reasons}"


def _mr(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


if __name__ == "__main__":
    sys.exit(main())
