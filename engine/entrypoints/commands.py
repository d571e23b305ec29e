"""The one registry of `specserve` subcommands: name -> (module, help).

Each module named here has ``add_arguments(parser)`` and ``run(args) -> int``. cli.py
reads this table; nothing here or in the modules imports cli.py back."""

from __future__ import annotations

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": (
        "engine.entrypoints.serve",
        "serve the model over gRPC (specserve.v1.Generation, and vllm.grpc.engine.VllmEngine "
        "for the smg gateway)",
    ),
    "generate": (
        "engine.entrypoints.generate",
        "generate text for one prompt, streamed to stdout",
    ),
    "train-draft": (
        "engine.entrypoints.train_draft",
        "train a draft model for a target, on this machine, from its own answers",
    ),
    "bench": (
        "engine.benchmarks.cli",
        "benchmarks: offline engine, block manager, gRPC serving",
    ),
}
