"""`specserve bench acceptance`: what verifying seeded requests by coupling costs.

Unseeded random requests are verified by rejection sampling, which accepts a draft with
probability min(1, p/q): the most a verifier can keep while staying exact. Seeded
requests are verified by coupling (a draft is kept when it equals the target's own
sample under the request's per-position noise), which makes their output independent of
batch and speculation but can accept fewer model drafts. For deterministic drafts
(n-gram lookup) both accept a draft d with probability p(d): coupling costs nothing.

The same prompts run twice in one invocation, unseeded and then with one seed per
request, at the same temperature; the table prints each run's acceptance and their
ratio.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from engine.benchmarks.offline import add_workload_args, spec_stats, tokenize_prompts
from engine.benchmarks.workloads import load_prompts
from engine.entrypoints.args import add_engine_args, engine_config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, num_prompts=16)
    parser.add_argument(
        "--temperature", type=float, default=0.7, help="sampling temperature of every request"
    )
    add_engine_args(parser)


def run(args: argparse.Namespace) -> int:
    from engine.core.llm_engine import LLMEngine
    from engine.loader import load_model

    if args.num_prompts < 1 or args.output_len < 1 or not args.temperature > 0:
        raise ValueError("--num-prompts and --output-len must be >= 1, --temperature > 0")
    config = engine_config_from_args(args)
    if config.resolved_speculative_method == "none":
        raise ValueError("--speculative-method none has no drafts to accept")
    # Speculation for every request, whatever the batch size.
    config = replace(config, speculative_disable_batch_size=max(config.max_num_seqs, 1))
    print(f"loading {config.model or 'the default model'}...", file=sys.stderr, flush=True)
    loaded = load_model(
        config.model,
        dtype=config.dtype,
        device=config.device,
        attn_backend=config.attn_backend,
        tokenizer=config.tokenizer,
        quantization=config.quantization,
    )
    prompts = tokenize_prompts(
        loaded.tokenizer, load_prompts(args.workload, args.num_prompts), not args.no_chat_template
    )
    rows = []
    for name, seeded in (("unseeded (rejection sampling)", False), ("seeded (coupling)", True)):
        print(f"running {name}...", file=sys.stderr, flush=True)
        engine = LLMEngine(config, loaded=loaded)
        rows.append((name, _run(engine, prompts, args.output_len, args.temperature, seeded)))
    _print(config, args, rows)
    return 0


def _run(engine, prompts, output_len: int, temperature: float, seeded: bool) -> dict:
    from engine.io.sampling_params import SamplingParams

    for i, ids in enumerate(prompts):
        params = SamplingParams(
            max_tokens=output_len,
            temperature=temperature,
            ignore_eos=True,
            seed=i if seeded else None,
        )
        engine.add_request(f"a{i}", ids, params)
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        if engine.last_step is not None:
            steps.append(engine.last_step)
    return spec_stats(steps)


def _print(config, args, rows) -> None:
    method = config.resolved_speculative_method
    print(
        f"\nacceptance, {method} drafts (k <= {config.num_speculative_tokens}), temperature "
        f"{args.temperature}, {args.num_prompts} prompts x {args.output_len} tokens"
    )
    print(f"{'verification':32} {'accepted/draft':>15} {'per-token a':>12} {'tokens/verif':>13}")
    for name, s in rows:
        print(
            f"{name:32} {s.get('acceptance_rate', 0):15.3f} "
            f"{s.get('per_token_acceptance', 0):12.3f} {s.get('tokens_per_verification', 0):13.3f}"
        )
    base, coupled = rows[0][1], rows[1][1]
    if base.get("per_token_acceptance"):
        ratio = coupled.get("per_token_acceptance", 0) / base["per_token_acceptance"]
        print(f"seeded / unseeded per-token acceptance: {ratio:.3f}")
