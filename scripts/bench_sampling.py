"""Sampling's per-step work on [rows, vocab] fp32 logits, the compiled kernels against
the torch ops they replace, each pair alternated in one process:

    .venv/bin/python scripts/bench_sampling.py --rows 32 --vocab 49152 --rounds 30

- noise: the exponential race's Exp(1) noise, ``exponential_rows`` against torch's
  ``exponential_`` (what engine/sample/sampler.py drew with before);
- argmax: greedy's ``row_argmax`` against torch's ``max(dim=-1)``;
- race: a whole sampled row, noise, division and argmax, both ways;
- inverse CDF: an unseeded row's draw as the verifier makes it now, ``sample_rows``
  (one uniform a row), against the race on torch's noise (what it made before).

Prints the median ms of each over ``--rounds`` and kernel / torch. torch runs on as
many threads as the kernels (torch.get_num_threads()).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32, help="rows sampled a step")
    parser.add_argument("--vocab", type=int, default=49152, help="the default model's")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if min(args.rows, args.vocab, args.rounds) < 1:
        parser.error("--rows, --vocab and --rounds must be at least 1")

    import torch

    from engine.kernels.cpu import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("error: the CPU kernels did not build (see the warning above)")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, generator=gen) * 3
    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs)
    keys = list(range(1, args.rows + 1))

    def torch_race():  # the baseline of both the race and the inverse CDF
        return (probs / noise.exponential_(generator=gen)).max(dim=-1).indices

    pairs = {
        "noise": (lambda: kernels.exponential_rows(noise, keys),
                  lambda: noise.exponential_(generator=gen)),
        "argmax": (lambda: kernels.row_argmax(logits), lambda: logits.max(dim=-1).indices),
        "race": (lambda: kernels.row_argmax(probs / kernels.exponential_rows(noise, keys)),
                 torch_race),
        "inverse CDF": (lambda: kernels.sample_rows(
                            probs, torch.rand(args.rows, dtype=torch.float64, generator=gen)),
                        torch_race),
    }  # fmt: skip
    print(f"[{args.rows}, {args.vocab}] fp32, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds, medians:")  # fmt: skip
    for name, (ours, theirs) in pairs.items():
        times: dict[str, list[float]] = {"kernel": [], "torch": []}
        for r in range(args.rounds + 1):  # round 0 warms up
            order = [("kernel", ours), ("torch", theirs)]
            for who, fn in order if r % 2 else order[::-1]:
                start = time.perf_counter()
                fn()
                if r:
                    times[who].append(time.perf_counter() - start)
        k, t = (1e3 * statistics.median(times[w]) for w in ("kernel", "torch"))
        print(f"  {name:11s} kernel {k:8.3f} ms   torch {t:8.3f} ms   kernel / torch {k / t:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
