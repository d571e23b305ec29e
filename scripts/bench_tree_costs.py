"""What a token-tree step costs and yields, against a plain step, on the default model.

    .venv/bin/python scripts/bench_tree_costs.py --modes eagle,eagle-tree,suffix,ngram

One request at a time (held-out chat prompts, greedy, bf16, the model as served), the
speculation gate off so every step adaptive k grants drafts is measured. Per mode:
plain steps' and speculating steps' mean time by phase (the proposer's, and the target
forward with verification), drafts (tree nodes) per speculating step, tokens per
speculating step (accepted + 1), the break-even: tokens a speculating step must
yield to match plain decoding at its cost (a mode pays where tokens per step exceed
it), and acceptance by depth: the share of speculating steps whose accepted path
reached depth 1, 2, 3 and 4.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="eagle,eagle-tree")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()

    from engine.benchmarks.offline import tokenize_prompts
    from engine.benchmarks.workloads import load_prompts
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.io.sampling_params import SamplingParams

    base = EngineConfig(speculative_method="none", dtype=args.dtype, device="cpu")
    plain = LLMEngine(base)
    prompts = tokenize_prompts(plain.tokenizer, load_prompts(args.workload, args.num_prompts), True)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    print("| mode | plain step ms | spec step: draft ms | spec step: forward+verify ms | "
          "nodes / spec step | tokens / spec step | break-even tokens | "
          "accepted to depth 1 / 2 / 3 / 4 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        config = replace(base, speculative_method=mode, speculation_gate=False)
        engine = LLMEngine(config, loaded=plain.loaded)
        warm = SamplingParams(max_tokens=8, ignore_eos=True)
        _run(engine, [("w", prompts[0], warm)])
        plain_ms, draft_ms, fwd_ms, nodes, tokens = [], [], [], [], []
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
                rec = engine.last_step
                if rec is None or rec.num_batched_tokens > 64:  # the prompt's prefill
                    continue
                t = rec.timings
                if rec.drafts_per_verification and rec.drafts_per_verification[0]:
                    draft_ms.append(1e3 * t.draft_s)
                    fwd_ms.append(1e3 * (t.prepare_s + t.forward_s))
                    nodes.append(rec.drafts_per_verification[0])
                    tokens.append(rec.accepted_per_verification[0] + 1)
                else:
                    plain_ms.append(1e3 * (t.draft_s + t.prepare_s + t.forward_s))
            print(f"{mode}: prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
        p = statistics.fmean(plain_ms)
        if not tokens:
            print(f"| {mode} | {p:.2f} | - | - | - | - | - | - |")
            continue
        d, f = statistics.fmean(draft_ms), statistics.fmean(fwd_ms)
        depths = " / ".join(
            f"{sum(t > depth for t in tokens) / len(tokens):.2f}" for depth in range(1, 5)
        )
        print(f"| {mode} | {p:.2f} | {d:.2f} | {f:.2f} | {statistics.fmean(nodes):.1f} | "
              f"{statistics.fmean(tokens):.2f} | {(d + f) / p:.2f} | {depths} |",
              flush=True)  # fmt: skip
    return 0


def _run(engine, work) -> None:
    for request in work:
        engine.add_request(*request)
    while engine.has_unfinished_requests():
        engine.step()


if __name__ == "__main__":
    sys.exit(main())
