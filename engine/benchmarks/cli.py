"""`specserve bench <name>`: each benchmark prints ratios against a baseline run in the
same invocation."""

from __future__ import annotations

import argparse
import importlib

# name -> (module, help). Each module has add_arguments(parser) and run(args) -> int.
BENCHMARKS = {
    "offline": (
        "engine.benchmarks.offline",
        "engine throughput/latency vs transformers generate() and generate_batch()",
    ),
    "step": (
        "engine.benchmarks.step",
        "where a CPU decode step's time goes: compiled kernels vs torch ops",
    ),
    "acceptance": (
        "engine.benchmarks.acceptance",
        "draft acceptance of seeded (coupled) vs unseeded (rejection-sampled) requests",
    ),
    "accuracy": (
        "engine.benchmarks.accuracy",
        "what quantized weights cost: perplexity, KL and top-1 agreement vs float32",
    ),
    "blocks": ("engine.benchmarks.blocks", "block manager operations per second"),
    "bounds": (
        "engine.benchmarks.bounds",
        "this machine's read bandwidth and multiply-add peaks, for reading the tables",
    ),
    "serve": (
        "engine.benchmarks.serve",
        "load-test a running server over gRPC, or an OpenAI API (the gateway) over HTTP",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True, help="the benchmark to run")
    for name, (module_name, help_text) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module_name).add_arguments(p)


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(BENCHMARKS[args.benchmark][0]).run(args)
