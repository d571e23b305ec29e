"""How long Python's garbage collector holds the interpreter (no stream advances then).

    .venv/bin/python scripts/gc_pauses.py heap
    .venv/bin/python scripts/gc_pauses.py run serve --port 50061

``heap``: loads an LLMEngine (the default model, or ``--model``), times three full
collections, freezes the heap as ``specserve serve`` does before it reports ready
(engine.core.async_engine.freeze_startup_heap), and times three more.
``run``: runs a specserve command in this process (``serve`` until SIGTERM or Ctrl-C,
``bench offline``, ...), printing each full collection (the oldest generation) as it
happens, seconds since start and milliseconds held, and at exit each generation's
count and total time.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import sys
import time


def _full_collection_ms() -> float:
    start = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - start) * 1e3


def heap(model: str | None) -> int:
    from engine.config import EngineConfig
    from engine.core.async_engine import freeze_startup_heap
    from engine.core.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model) if model else EngineConfig())
    print(f"objects tracked: {len(gc.get_objects())}")
    before = [_full_collection_ms() for _ in range(3)]
    print("full collection ms: " + ", ".join(f"{t:.1f}" for t in before))
    print(f"frozen: {freeze_startup_heap()} objects")
    after = [_full_collection_ms() for _ in range(3)]
    print("full collection ms, frozen: " + ", ".join(f"{t:.1f}" for t in after))
    del engine
    return 0


def run(command: list[str]) -> int:
    began = time.perf_counter()
    totals = {g: [0, 0.0] for g in range(3)}
    started: dict[int, float] = {}

    def watch(phase: str, info: dict) -> None:
        generation = info["generation"]
        if phase == "start":
            started[generation] = time.perf_counter()
            return
        held = time.perf_counter() - started[generation]
        totals[generation][0] += 1
        totals[generation][1] += held
        if generation == 2:
            now = time.perf_counter() - began
            print(f"gc: full collection at {now:.2f} s held {held * 1e3:.1f} ms",
                  file=sys.stderr, flush=True)  # fmt: skip

    def report() -> None:
        parts = [f"gen {g}: {n} in {t * 1e3:.1f} ms" for g, (n, t) in totals.items()]
        print("gc: " + "; ".join(parts), file=sys.stderr, flush=True)

    gc.callbacks.append(watch)
    atexit.register(report)
    from engine.entrypoints.cli import main as cli

    return cli(command)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    heap_parser = sub.add_parser("heap")
    heap_parser.add_argument("--model", default=None, help="default: the built-in default model")
    run_parser = sub.add_parser("run")
    run_parser.add_argument("command", nargs=argparse.REMAINDER, help="a specserve command")
    # run's command may start with an option of its own (run --version): not parsed here
    args, rest = parser.parse_known_args()
    if args.what == "heap":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return heap(args.model)
    command = rest + args.command
    if not command:
        parser.error("run needs a specserve command, e.g. run serve --port 50061")
    return run(command)


if __name__ == "__main__":
    sys.exit(main())
