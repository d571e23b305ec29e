"""The `specserve` command line. Argument parsing lives here and nowhere else."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import fields

from engine.config import ATTENTION_BACKENDS, DTYPES, SPECULATIVE_METHODS, EngineConfig

# Subcommands register here: name -> (add_arguments, run). Each run returns an exit code.
_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable]] = {}

# The engine's defaults, from EngineConfig itself: flags never restate them.
_ENGINE_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}

_DESCRIPTION = (
    "specserve: LLM serving with paged KV cache, continuous batching and batched "
    "speculative decoding. `specserve COMMAND --help` lists a command's flags."
)

# Where _EngineFlag records the engine flags given on the command line.
GIVEN_ENGINE_FLAGS = "given_engine_flags"


def command(name: str, help_text: str):
    def register(fns: tuple[Callable, Callable]):
        _COMMANDS[name] = (help_text, *fns)
        return fns

    return register


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" to a flag's help when X says something (not None, not an
    off switch) and the help does not already explain its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or default is None
            or default is False
            or default == argparse.SUPPRESS
            or "default" in help_text
        ):
            return help_text
        return f"{help_text} (default: %(default)s)"


class _EngineFlag(argparse.Action):
    """Stores a value (with nargs=0: ``const``) and records the flag as given, so that
    `generate --server` can refuse engine flags, which only a local engine reads."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        given = getattr(namespace, GIVEN_ENGINE_FLAGS, ())
        setattr(namespace, GIVEN_ENGINE_FLAGS, (*given, self.option_strings[0]))


def add_engine_args(parser: argparse.ArgumentParser, *, with_seed: bool = True) -> None:
    """Every EngineConfig field as a flag; shared by generate, serve and bench.
    `specserve generate` uses --seed for its request, so it leaves the engine's out."""
    d = _ENGINE_DEFAULTS
    parser.set_defaults(**{GIVEN_ENGINE_FLAGS: ()})
    g = parser.add_argument_group("engine")

    def flag(name: str, help_text: str, **kwargs) -> None:
        dest = name.removeprefix("--").replace("-", "_")
        kwargs.setdefault("default", d.get(dest))
        if kwargs.get("type") is int:
            kwargs.setdefault("metavar", "N")
        g.add_argument(name, action=_EngineFlag, help=help_text, **kwargs)

    flag("--model", "HF directory, .gguf file or hub id (default: smollm2-135m-instruct)")
    flag(
        "--tokenizer",
        "directory holding the tokenizer files (tokenizer.json, tokenizer_config.json ...) "
        "for a --model without them (default: the model's own)",
    )
    flag("--draft-model", "small draft model sharing the tokenizer")
    flag(
        "--speculative-method",
        "default: draft if --draft-model is given, else ngram",
        choices=SPECULATIVE_METHODS,
    )
    flag(
        "--num-speculative-tokens",
        "the most draft tokens a request verifies per step",
        type=int,
    )
    flag(
        "--speculative-disable-batch-size",
        "above this many running requests nobody speculates (default: 4 on CPU, 16 on CUDA)",
        type=int,
    )
    flag("--block-size", "tokens per KV cache block: 8, 16, 32 or 64", type=int)
    flag(
        "--num-kv-blocks",
        "KV cache blocks (default: as many as --kv-cache-memory-gib holds)",
        type=int,
    )
    flag(
        "--kv-cache-memory-gib",
        "memory for all KV caches, target and draft, when --num-kv-blocks is not given",
        type=float,
        metavar="GIB",
    )
    flag("--max-num-seqs", "the most requests running at once", type=int)
    flag("--max-num-batched-tokens", "the most tokens one engine step computes", type=int)
    flag(
        "--max-model-len",
        "the most tokens (prompt + output) per request (default: the model's context length)",
        type=int,
    )
    flag(
        "--max-waiting-requests",
        "the most requests waiting to run; further ones are refused",
        type=int,
    )
    flag(
        "--no-prefix-caching",
        "do not reuse the KV cache of shared prompt prefixes",
        nargs=0,
        const=True,
        default=False,
    )
    flag("--device", "auto, cpu, cuda or cuda:N")
    flag(
        "--dtype",
        "auto: bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16, AMX, Arm BF16), "
        "else float32; float32 for exact parity with transformers fp32",
        choices=DTYPES,
    )
    flag(
        "--attn-backend",
        "auto: xformers on CUDA when installed, the compiled kernels for float32 on CPU, "
        "else torch",
        choices=ATTENTION_BACKENDS,
    )
    flag("--num-threads", "torch CPU threads (default: one per core)", type=int)
    if with_seed:
        flag("--seed", "engine seed for unseeded requests", type=int)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
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
        seed=getattr(args, "seed", _ENGINE_DEFAULTS["seed"]),
        num_threads=args.num_threads,
    )


def version() -> str:
    """The installed package's version; "unknown (...)" for a source tree never installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("specserve")
    except PackageNotFoundError:
        return "unknown (not installed; run scripts/install.sh)"


def build_parser() -> argparse.ArgumentParser:
    _load_commands()
    parser = argparse.ArgumentParser(prog="specserve", description=_DESCRIPTION)
    parser.add_argument(
        "--version", action="version", version=f"specserve {version()}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True, help="what to run")
    for name, (help_text, add_arguments, _run) in _COMMANDS.items():
        add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    for p in iter_parsers(parser):
        p.formatter_class = HelpFormatter
    return parser


def iter_parsers(parser: argparse.ArgumentParser):
    """``parser`` and every subcommand's parser below it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from iter_parsers(child)


def _load_commands() -> None:
    # Importing these modules registers their subcommands.
    import engine.commands  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # The command as typed, for outputs that record how they were made.
    args.argv = ["specserve", *(sys.argv[1:] if argv is None else argv)]
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
