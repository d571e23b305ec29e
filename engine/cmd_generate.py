"""`specserve generate "prompt"`: offline generation, streamed to stdout; or, with
--server, the same against a running specserve server."""

from __future__ import annotations

import argparse
import sys

from engine.cli import add_engine_args, command, engine_config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument(
        "--seed", dest="request_seed", type=int, default=None, help="sampling seed for this request"
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt as a user message in the model's chat template",
    )
    parser.add_argument(
        "--server",
        default=None,
        help="HOST:PORT of a running specserve server instead of a local model",
    )
    parser.add_argument("--api-key", default=None, help="bearer token for --server")
    parser.add_argument("--stats", action="store_true", help="print speed and speculation stats")
    add_engine_args(parser, with_seed=False)


def run(args: argparse.Namespace) -> int:
    if args.server:
        from engine.client import stream_generate_cli

        return stream_generate_cli(
            args.server,
            args.prompt,
            args.max_tokens,
            args.temperature,
            args.request_seed,
            args.chat,
            args.api_key,
        )
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.request_seed,
    )
    config = engine_config_from_args(args)
    print("loading model...", file=sys.stderr, flush=True)
    engine = LLMEngine(config)
    if args.chat:
        engine.add_request("cli", None, params, messages=[{"role": "user", "content": args.prompt}])
    else:
        engine.add_request("cli", args.prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            final = delta
    sys.stdout.write("\n")
    if args.stats and final is not None:
        _print_stats(final)
    return 0


def _print_stats(output) -> None:
    m = output.metrics
    total = m.finished_time - m.arrival_time
    print(
        f"[{output.finish_reason}] ttft {m.time_to_first_token * 1000:.0f} ms, "
        f"total {total:.2f} s, drafts {m.num_draft_tokens}, accepted {m.num_accepted_tokens}",
        file=sys.stderr,
    )


command("generate", "generate text for one prompt, streamed to stdout")((add_arguments, run))
