"""The one-call decoder's step with the final norm and LM head in its call, against the
same step with them in Python after it, alternated step by step on one runner.

    .venv/bin/python scripts/bench_head_in_call.py --level x86-64-v3 --dtype float32

The default model as served, ``--batch`` sequences of ``--context`` tokens (their
blocks drawn at random from a 1 GiB cache, as ``bench_fused_decoder.py --scatter``
does), one decode step timed ``--rounds`` times each way, the way that goes first
turning round by round. Prints the medians, their ratio and the read bound measured
after; checks that both ways give the same logits.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--level", default="native", help="native or a prebuilt kernel level")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    if min(args.batch, args.context, args.rounds) < 1:
        parser.error("--batch, --context and --rounds must be at least 1")

    import torch

    from engine.benchmarks import bounds as bounds_mod
    from engine.core.model_runner import ModelRunner, SeqInput
    from engine.kernels import build as build_mod
    from engine.kernels import cpu as cpu_mod
    from engine.kernels import quant as quant_mod
    from engine.kernels.cpu import CpuKernels
    from engine.loader import load_model
    from engine.models import layers as layers_mod

    if args.level != "native":
        reason = build_mod.level_unrunnable(args.level)
        if reason is not None:
            parser.error(f"--level {args.level!r}: {reason}")
        print(f"building the {args.level} kernels ...", file=sys.stderr)
        out = Path(tempfile.mkdtemp())
        kernels = CpuKernels(build_mod.prebuild(out, only=[args.level])[0])
        for module in (cpu_mod, layers_mod, quant_mod):
            module.cpu_kernels = lambda k=kernels: k
    loaded = load_model(None, dtype=args.dtype, device="cpu", quantization="auto")
    need = (args.context + 24) // 16 + 1  # blocks a sequence holds
    num_blocks = max(1456, args.batch * need + 1)
    runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=16)
    fused = runner.model.model.fused
    if fused is None or not fused.has_head:
        raise SystemExit("error: this model and level give no one-call decoder with the head")
    ids = random.Random(0).sample(range(1, num_blocks), need * args.batch)
    tables = [ids[i * need : (i + 1) * need] for i in range(args.batch)]
    seqs = [[100 + (i + 7 * b) % 1000 for i in range(args.context + 1)] for b in range(args.batch)]
    for tokens, blocks in zip(seqs, tables, strict=True):
        runner.forward([SeqInput(tokens[:-1], 0, blocks, 1)])
    step = [SeqInput(t[-1:], args.context, b, 1) for t, b in zip(seqs, tables, strict=True)]
    head = fused._head
    times: dict[bool, list[float]] = {True: [], False: []}
    logits: dict[bool, torch.Tensor] = {}
    for r in range(args.rounds):
        for in_call in (True, False) if r % 2 else (False, True):
            fused._head = head if in_call else None  # None: the head in Python
            prepared = runner.prepare(step)
            start = time.perf_counter()
            logits[in_call] = runner.execute(prepared)
            times[in_call].append(time.perf_counter() - start)
    fused._head = head
    if not torch.equal(logits[True], logits[False]):
        raise SystemExit("error: the head in the call gave other logits than in Python")
    ours, theirs = (statistics.median(times[k]) for k in (True, False))
    bound = bounds_mod.measure()
    print(f"{args.level} {args.dtype} {args.batch} x {args.context}: head in the call "
          f"{1e3 * ours:.3f} ms, in Python {1e3 * theirs:.3f} ms, ratio {ours / theirs:.3f} "
          f"(read bound {bound.read_gbps:.1f} GB/s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
