"""What the speculation gate does, step by step, on the default model (or `--model`).

    .venv/bin/python scripts/bench_gate.py --modes none,eagle,eagle-nogate --concurrency 4

For each mode (after an 8-token warm-up of one batch, which is also when the gate first
measures): the timed run's output tokens per second, the time its steps spent
speculating and not, how many steps the gate held plain, and the gate's measured
rates per batch-size bucket. Step times come from inside one process, so they are
steadier than a throughput ratio between runs made minutes apart on a shared VM.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from engine.benchmarks.report import median_range


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="none,eagle,eagle-nogate")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--workload", default="chat", help="chat or grounded (workloads.py)")
    parser.add_argument("--num-prompts", type=int, default=None, help="default: 2 batches")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="an HF dir or .gguf (default: the default)")
    parser.add_argument("--draft-model", default=None, help="for drafted modes with --model")
    args = parser.parse_args()

    from engine.benchmarks.offline import NO_GATE, tokenize_prompts
    from engine.benchmarks.workloads import load_prompts
    from engine.config import DRAFTED_METHODS, EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.io.sampling_params import SamplingParams

    base = EngineConfig(speculative_method="none", dtype=args.dtype, device="cpu", model=args.model)
    plain = LLMEngine(base)
    num_prompts = args.num_prompts or 2 * args.concurrency
    prompts = tokenize_prompts(plain.tokenizer, load_prompts(args.workload, num_prompts), True)
    params = SamplingParams(
        max_tokens=args.output_len, temperature=args.temperature, ignore_eos=True
    )
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes:
            method = mode.removesuffix(NO_GATE)
            drafted = method in (*DRAFTED_METHODS, "auto")
            config = replace(
                base,
                speculative_method=method,
                speculation_gate=not mode.endswith(NO_GATE),
                draft_model=args.draft_model if drafted else None,
            )
            engine = LLMEngine(config, loaded=plain.loaded)
            warm = SamplingParams(max_tokens=8, ignore_eos=True)
            _drive(engine, [(f"w{i}", p, warm) for i, p in enumerate(prompts[: args.concurrency])],
                   args.concurrency)  # fmt: skip
            gate = engine.scheduler.gate
            held0 = engine.scheduler.num_gated_steps
            work = [(f"r{i}", p, params) for i, p in enumerate(prompts)]
            seconds, split = _drive(engine, work, args.concurrency)
            tokens = len(prompts) * args.output_len
            rates[mode].append(tokens / seconds)
            held = engine.scheduler.num_gated_steps - held0
            state = {
                lane or "all": {b: f"{s:.0f}/{p:.0f}" for b, (s, p) in gate.state(lane).items()}
                for lane in gate.lanes()
            } if gate else "-"  # fmt: skip
            print(
                f"round {r} {mode:>14}: {tokens / seconds:7.1f} tok/s; steps: "
                f"{split['plain_n']} plain {split['plain']:.2f} s, {split['spec_n']} speculating "
                f"{split['spec']:.2f} s, gate held {held} steps; gate spec/plain tok/s by "
                f"lane and bucket {state}",
                file=sys.stderr,
                flush=True,
            )
    print(
        f"| mode | tok/s, {args.concurrency} concurrent, median (range) of {args.rounds} "
        "| vs none |"
    )
    print("|---|---|---|")
    for mode in modes:
        ratio = [a / b for a, b in zip(rates[mode], rates.get("none", rates[mode]))]
        print(
            f"| {mode} | {median_range(rates[mode], '{:.1f}')} | {median_range(ratio, '{:.2f}x')} |"
        )
    return 0


def _drive(engine, work, concurrency: int):
    """Run ``work`` with at most ``concurrency`` in flight; (seconds, step time split)."""
    split = {"plain": 0.0, "plain_n": 0, "spec": 0.0, "spec_n": 0}
    pending = list(work)
    started = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and engine.scheduler.num_running + engine.num_waiting_requests < concurrency:
            engine.add_request(*pending.pop(0))
        t0 = time.perf_counter()
        engine.step()
        kind = "spec" if engine.last_step and engine.last_step.drafts_per_verification else "plain"
        split[kind] += time.perf_counter() - t0
        split[kind + "_n"] += 1
    return time.perf_counter() - started, split


if __name__ == "__main__":
    sys.exit(main())
