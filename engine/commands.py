"""Importing this module registers every `specserve` subcommand."""

from __future__ import annotations

import contextlib

import engine.benchmarks.cli  # noqa: F401
import engine.cmd_generate  # noqa: F401
import engine.cmd_train_draft  # noqa: F401

# The gRPC server registers `serve` once it is importable.
with contextlib.suppress(ImportError):
    import engine.cmd_serve  # noqa: F401
