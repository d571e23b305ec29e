"""`specserve generate "prompt"`: one prompt, streamed to stdout, from a local engine or,
with --server, from a running specserve server. Both modes take the same sampling flags
with the same defaults, the API's own (SamplingParams), and validate them the same way."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import MISSING, fields
from typing import NamedTuple

from engine.entrypoints.args import GIVEN_ENGINE_FLAGS, add_engine_args, engine_config_from_args
from engine.io.sampling_params import SamplingParams

_DEFAULTS = {f.name: f.default for f in fields(SamplingParams) if f.default is not MISSING}

# The sampling fields this command carries, as SamplingParams and build_request name them.
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop")
_SAMPLING_FIELDS += ("ignore_eos", "structured_output")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt as a user message in the model's chat template",
    )
    parser.add_argument(
        "--stats",
        action="store_true",
        help="print tokens, time to first token, total time and speculation counts to stderr",
    )
    _add_sampling_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument(
        "--server",
        default=None,
        help="HOST:PORT of a running specserve server instead of a local model",
    )
    g.add_argument("--api-key", default=None, help="bearer token for --server")
    add_engine_args(parser, with_seed=False)


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    g = parser.add_argument_group("sampling (the API's defaults, locally and with --server)")
    g.add_argument(
        "--max-tokens", type=int, default=d["max_tokens"], help="the most tokens to generate"
    )
    g.add_argument(
        "--temperature", type=float, default=d["temperature"], help="0 is greedy decoding"
    )
    g.add_argument(
        "--top-k", type=int, default=d["top_k"], help="sample among the k likeliest tokens; 0: all"
    )
    g.add_argument(
        "--top-p",
        type=float,
        default=d["top_p"],
        help="sample among the likeliest tokens whose probabilities add up to p; 1: all",
    )
    g.add_argument(
        "--min-p",
        type=float,
        default=d["min_p"],
        help="drop tokens less likely than min-p times the likeliest; 0: none",
    )
    # dest differs from the flag: args.seed would be read as the engine's seed.
    g.add_argument(
        "--seed",
        dest="request_seed",
        type=int,
        default=d["seed"],
        metavar="SEED",
        help="sampling seed for this request: the same seed gives the same output, "
        "with or without speculation and whatever else a server runs (default: none, "
        "not reproducible)",
    )
    g.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="end the output at this text (repeatable)",
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="keep generating past the end-of-sequence token, up to --max-tokens",
    )
    c = g.add_mutually_exclusive_group()
    c.add_argument(
        "--json-schema", metavar="FILE", help="the output is JSON valid against this schema file"
    )
    c.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    c.add_argument("--regex", metavar="REGEX", help="the whole output matches this regex")
    c.add_argument(
        "--choice", metavar="A,B,...", help="the output is one of these comma-separated strings"
    )
    c.add_argument(
        "--grammar",
        metavar="FILE",
        help="the output matches this grammar file: Lark (rule start) or GBNF (rule root)",
    )


class _Stats(NamedTuple):
    finish_reason: str | None
    num_tokens: int
    ttft_s: float | None
    total_s: float
    num_draft_tokens: int
    num_accepted_tokens: int


def run(args: argparse.Namespace) -> int:
    sampling = _sampling_kwargs(args)
    SamplingParams(**sampling)  # one validation, one error text, in both modes
    prompt = (
        {"messages": [{"role": "user", "content": args.prompt}]}
        if args.chat
        else {"prompt": args.prompt}
    )
    if args.server:
        _refuse_engine_flags(getattr(args, GIVEN_ENGINE_FLAGS))
        stats = _generate_remote(args.server, args.api_key, prompt, sampling)
    else:
        if args.api_key is not None:
            raise ValueError("--api-key only applies with --server")
        stats = _generate_local(args, prompt, sampling)
    if args.stats and stats is not None:
        print(_stats_line(stats), file=sys.stderr)
    return 0


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    values = vars(args) | {"seed": args.request_seed, "stop": args.stop or []}
    values["structured_output"] = _constraint(args)
    return {name: values[name] for name in _SAMPLING_FIELDS}


def _constraint(args: argparse.Namespace) -> dict | None:
    """The output constraint the flags ask for, as a dict of one StructuredOutput field."""
    if args.json_schema is not None:
        return {"json_schema": _read(args.json_schema, "--json-schema")}
    if args.grammar is not None:
        return {"grammar": _read(args.grammar, "--grammar")}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice is not None:
        return {"choice": [c for c in args.choice.split(",") if c]}
    return {"json_object": True} if args.json_object else None


def _read(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror}") from None


def _refuse_engine_flags(given: tuple[str, ...]) -> None:
    if not given:
        return
    flags = ", ".join(dict.fromkeys(given))
    verb = "is an engine flag and does" if len(set(given)) == 1 else "are engine flags and do"
    raise ValueError(f"{flags} {verb} nothing with --server (the server already loaded its model)")


def _generate_local(args: argparse.Namespace, prompt: dict, sampling: dict) -> _Stats | None:
    from engine.core.llm_engine import LLMEngine

    config = engine_config_from_args(args)
    print("loading model...", file=sys.stderr, flush=True)
    engine = LLMEngine(config)
    engine.add_request(
        "cli", prompt.get("prompt"), SamplingParams(**sampling), messages=prompt.get("messages")
    )
    final, num_tokens = None, 0
    try:
        while engine.has_unfinished_requests():
            for delta in engine.step():
                _write(delta.text)
                num_tokens += len(delta.token_ids)
                final = delta
    finally:
        sys.stdout.write("\n")
    if final is None:
        return None
    m = final.metrics
    total = (m.finished_time or time.monotonic()) - m.arrival_time
    return _Stats(
        final.finish_reason,
        num_tokens,
        m.time_to_first_token,
        total,
        m.num_draft_tokens,
        m.num_accepted_tokens,
    )


def _generate_remote(
    server: str, api_key: str | None, prompt: dict, sampling: dict
) -> _Stats | None:
    from engine.client import SpecserveClient

    start = time.monotonic()
    final = None
    with SpecserveClient(server, api_key=api_key) as client:
        try:
            for delta in client.generate(**prompt, **sampling):
                _write(delta.text)
                final = delta
        finally:
            sys.stdout.write("\n")
    if final is None or final.usage is None:
        return None
    u = final.usage
    return _Stats(
        final.finish_reason,
        u.completion_tokens,
        u.time_to_first_token_s,
        time.monotonic() - start,
        u.draft_tokens,
        u.accepted_draft_tokens,
    )


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _stats_line(s: _Stats) -> str:
    ttft = "-" if s.ttft_s is None else f"{s.ttft_s * 1000:.0f} ms"
    return (
        f"[{s.finish_reason}] {s.num_tokens} tokens, ttft {ttft}, total {s.total_s:.2f} s, "
        f"drafts {s.num_draft_tokens}, accepted {s.num_accepted_tokens}"
    )
