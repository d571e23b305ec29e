"""The `specserve` command line: builds the parser from the subcommand registry
(commands.py) and runs one subcommand, turning its errors into one line."""

from __future__ import annotations

import argparse
import importlib
import sys

from engine import version
from engine.entrypoints.commands import COMMANDS

_DESCRIPTION = (
    "specserve: LLM serving with paged KV cache, continuous batching and batched "
    "speculative decoding. `specserve COMMAND --help` lists a command's flags."
)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=_DESCRIPTION)
    parser.add_argument(
        "--version", action="version", version=f"specserve {version()}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True, help="what to run")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # The command as typed, for outputs that record how they were made.
    args.argv = ["specserve", *(sys.argv[1:] if argv is None else argv)]
    run = importlib.import_module(COMMANDS[args.command][0]).run
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
    sys.exit(main())
