"""What a light constraint's matcher costs per engine step, against the step budget
(docs/benchmarks.md, "A failing constraint beside free requests"): the statistical
test's constrained case (tests/engine/test_lossless_sampling.py: the tiny model, 4,000
seeded requests at temperature 1 under the regex [0-9A-Za-z]{4}, n-gram trees), with
each request's matcher CPU time recorded at every step.

    .venv/bin/python scripts/constraint_step_costs.py --rounds 3

Prints, per round, the steps recorded and the largest, 99.9th percentile and median
per-step cost in ms, beside the default budget: how far a spike the operating system
charges to the thread is from anything the matcher itself does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.io.sampling_params import SamplingParams, StructuredOutput  # noqa: E402
from engine.sample import grammar as grammar_mod  # noqa: E402
from tests.engine.engine_helpers import make_engine, run_to_completion  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

PROMPT = [20, 49, 20, 49, 20, 49]  # the statistical test's: n-gram lookup drafts here
CONSTRAINT = StructuredOutput(regex="[0-9A-Za-z]{4}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4000)
    args = parser.parse_args()
    if args.rounds < 1 or args.requests < 1:
        parser.error("--rounds and --requests must be >= 1")
    costs: list[float] = []
    start_step = grammar_mod.Grammar.start_step

    def recording(self) -> None:  # the step that just ended, before the budget restarts
        if self._steps:
            costs.append(self.step_seconds)
        start_step(self)

    grammar_mod.Grammar.start_step = recording
    budget_ms = grammar_mod.GrammarLimits().step_budget_ms
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(tmp)
        print(f"default step budget {budget_ms:g} ms")
        print("| round | steps | max ms | p99.9 ms | median ms |")
        print("|---|---|---|---|---|")
        for r in range(args.rounds):
            print(f"[round {r + 1}/{args.rounds}]", file=sys.stderr, flush=True)
            costs.clear()
            engine = make_engine(
                model, speculative_method="ngram-tree", speculative_disable_batch_size=4096,
                num_kv_blocks=1200, seed=5, structured_output_step_budget_ms=6e4,
            )  # fmt: skip
            params = [
                SamplingParams(max_tokens=4, temperature=1.0, top_k=2, ignore_eos=True,
                               num_speculative_tokens=2, seed=1000 + i,
                               structured_output=CONSTRAINT)
                for i in range(args.requests)
            ]  # fmt: skip
            run_to_completion(engine, {0: [(f"s{i}", PROMPT, p) for i, p in enumerate(params)]})
            ms = sorted(1e3 * c for c in costs)
            p999 = ms[min(len(ms) - 1, int(0.999 * len(ms)))]
            print(f"| {r + 1} | {len(ms)} | {ms[-1]:.3f} | {p999:.3f} | "
                  f"{statistics.median(ms):.3f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
