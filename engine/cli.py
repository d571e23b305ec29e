"""The `specserve` command line. Argument parsing lives here and nowhere else."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from engine.config import ATTENTION_BACKENDS, DTYPES, SPECULATIVE_METHODS, EngineConfig

# Subcommands register here: name -> (add_arguments, run). Each run returns an exit code.
_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable]] = {}


def command(name: str, help_text: str):
    def register(fns: tuple[Callable, Callable]):
        _COMMANDS[name] = (help_text, *fns)
        return fns

    return register


def add_engine_args(parser: argparse.ArgumentParser, *, with_seed: bool = True) -> None:
    """Every EngineConfig field as a flag; shared by generate, serve and bench.
    `specserve generate` uses --seed for its request, so it leaves the engine's out."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="HF directory, .gguf file or hub id (default: smollm2-135m-instruct)",
    )
    g.add_argument("--draft-model", default=None, help="small draft model sharing the tokenizer")
    g.add_argument(
        "--speculative-method",
        choices=SPECULATIVE_METHODS,
        default=None,
        help="default: draft if --draft-model is given, else ngram",
    )
    g.add_argument("--num-speculative-tokens", type=int, default=4)
    g.add_argument(
        "--speculative-disable-batch-size",
        type=int,
        default=None,
        help="above this many running requests nobody speculates (default: 4 on CPU, 16 on CUDA)",
    )
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-waiting-requests", type=int, default=1024)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--dtype", choices=DTYPES, default="auto")
    g.add_argument("--attn-backend", choices=ATTENTION_BACKENDS, default="auto")
    g.add_argument(
        "--num-threads", type=int, default=None, help="torch CPU threads (default: one per core)"
    )
    if with_seed:
        g.add_argument("--seed", type=int, default=0, help="engine seed for unseeded requests")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        draft_model=args.draft_model,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_disable_batch_size=args.speculative_disable_batch_size,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gib=args.kv_cache_memory_gib,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_waiting_requests=args.max_waiting_requests,
        enable_prefix_caching=not args.no_prefix_caching,
        device=args.device,
        dtype=args.dtype,
        attn_backend=args.attn_backend,
        seed=getattr(args, "seed", 0),
        num_threads=args.num_threads,
    )


def build_parser() -> argparse.ArgumentParser:
    _load_commands()
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, _run) in _COMMANDS.items():
        add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def _load_commands() -> None:
    # Importing these modules registers their subcommands.
    import engine.commands  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _help, _add, run = _COMMANDS[args.command]
    try:
        return int(run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"specserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a failed RPC: one line with its status, not a traceback
        code, details = getattr(exc, "code", None), getattr(exc, "details", None)
        if not (callable(code) and callable(details)):
            raise
        print(
            f"specserve {args.command}: error: {code().name}: {details()}",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    # Run through the imported module so subcommands register into one registry.
    from engine.cli import main as _main

    sys.exit(_main())
