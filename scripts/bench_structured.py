"""Structured output on CPU: the rounds of docs/benchmarks.md "Structured output".

    .venv/bin/python scripts/bench_structured.py --rounds 5 --out bench-structured/

Each round runs `specserve bench offline --workload json` (extraction: a JSON schema per
request; each mode runs the prompts with their schemas, then free) five times: at
batch 1 with no speculation, n-gram and hybrid; the same at batch 1 with no speculation
and the constraints' forced tokens decoded one step each (SPECSERVE_FORCED_TOKENS=0,
what forced-token drafts bring); and 32 requests at once with no speculation (all with
their schemas, all free, then every other one with its schema: what constrained
requests cost the free ones beside them); and the batch-1 and 32-request runs again with
every greedy row's mask computed beside the forward (SPECSERVE_LAZY_GREEDY_MASKS=0: what
masking only the rows whose argmax the constraint refuses brings). A finished run's JSON
is kept in --out and not rerun, so an interrupted series resumes.
Prints one markdown table: the median (range) over rounds, each ratio within one
invocation or, where it says "paired", between two invocations of the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from engine.benchmarks.report import median_range

COMMON = ["--workload", "json", "--output-len", "192", "--baselines", "none"]
BATCH1 = [*COMMON, "--num-prompts", "8", "--concurrency", "1"]
RUNS = {
    "b1": ([*BATCH1, "--spec-modes", "none,ngram,hybrid"], {}),
    "b1-unforced": ([*BATCH1, "--spec-modes", "none"], {"SPECSERVE_FORCED_TOKENS": "0"}),
    "b32": ([*COMMON, "--num-prompts", "32", "--spec-modes", "none"], {}),
    "b1-eager": ([*BATCH1, "--spec-modes", "none,ngram"], {"SPECSERVE_LAZY_GREEDY_MASKS": "0"}),
    "b32-eager": ([*COMMON, "--num-prompts", "32", "--spec-modes", "none"],
                  {"SPECSERVE_LAZY_GREEDY_MASKS": "0"}),
}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench-structured")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rounds = []
    for r in range(args.rounds):
        results = {}
        for name, (flags, env) in RUNS.items():
            path = out / f"{name}-r{r}.json"
            if not path.exists():
                cmd = [sys.executable, "-m", "engine", "bench", "offline", *flags]
                cmd += ["--json", str(path), "--no-progress"]
                prefix = " ".join(f"{k}={v}" for k, v in env.items())
                print(f"[round {r + 1}/{args.rounds}] + {prefix} specserve bench offline", *flags,
                      file=sys.stderr, flush=True)  # fmt: skip
                subprocess.run(
                    cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, **env}
                )
            rows = json.loads(path.read_text())["results"]
            results[name] = {row["system"]: row for row in rows}
        rounds.append(results)
    from engine.benchmarks import bounds

    print(bounds.line())  # now, beside the table; each run's JSON has its own
    print(_table(rounds))
    return 0


def _col(rounds, run: str, system: str, key: str = "output_tokens_per_s") -> list[float]:
    if key == "valid_json":
        return [r[run][system]["spec"]["valid_json"] for r in rounds]
    return [r[run][system][key] for r in rounds]


def _ratio(a: list[float], b: list[float]) -> str:
    return median_range([x / y for x, y in zip(a, b, strict=True)], "{:.2f}x")


def _table(rounds: list[dict]) -> str:
    lines = [
        "| run | json tok/s | valid | free tok/s | json / free | vs no speculation |",
        "|---|---|---|---|---|---|",
    ]
    plain = _col(rounds, "b1", "specserve (spec: none, json schema)")
    for run, mode, label in (
        ("b1-unforced", "none", "batch 1, no speculation, forced tokens one step each"),
        ("b1", "none", "batch 1, no speculation (forced-token drafts)"),
        ("b1", "ngram", "batch 1, n-gram"),
        ("b1", "hybrid", "batch 1, hybrid"),
        ("b32", "none", "32 at once, no speculation"),
    ):
        json_rate = _col(rounds, run, f"specserve (spec: {mode}, json schema)")
        free_rate = _col(rounds, run, f"specserve (spec: {mode})")
        valid = _col(rounds, run, f"specserve (spec: {mode}, json schema)", "valid_json")
        versus = "-" if run == "b32" else _ratio(json_rate, plain)
        if run == "b1-unforced":
            versus += " (paired)"
        lines.append(
            f"| {label} | {median_range(json_rate, '{:.1f}')} | {100 * min(valid):.0f}% | "
            f"{median_range(free_rate, '{:.1f}')} | {_ratio(json_rate, free_rate)} | {versus} |"
        )
    mixed = "specserve (spec: none, half json schema)"
    json32 = "specserve (spec: none, json schema)"
    half = [r["b32"][mixed]["spec"]["free_tpot_ms"] for r in rounds]
    alone = [r["b32"]["specserve (spec: none)"]["tpot_ms"]["mean"] for r in rounds]
    lines.append(
        f"\n32 at once, every other request constrained: the free requests' TPOT "
        f"{median_range(half, '{:.1f}')} ms, against {median_range(alone, '{:.1f}')} ms with "
        f"none constrained ({_ratio(half, alone)} paired, within each round)"
    )
    unforced = _col(rounds, "b1-unforced", "specserve (spec: none, json schema)")
    lines.append(
        f"\nforced-token drafts at batch 1, no speculation (paired): {_ratio(plain, unforced)}; "
        f"n-gram with them over no speculation without them (paired): "
        f"{_ratio(_col(rounds, 'b1', 'specserve (spec: ngram, json schema)'), unforced)}"
    )
    eager_tpot = [r["b32-eager"][mixed]["spec"]["free_tpot_ms"] for r in rounds]
    eager_alone = [r["b32-eager"]["specserve (spec: none)"]["tpot_ms"]["mean"] for r in rounds]
    lines.append(
        "\ngreedy rows masked only where the argmax is refused, over every row's mask beside "
        "the forward (paired): batch 1 json "
        + ", ".join(
            f"{mode} {_ratio(_col(rounds, 'b1', s), _col(rounds, 'b1-eager', s))}"
            for mode in ("none", "ngram")
            for s in [f"specserve (spec: {mode}, json schema)"]
        )
        + "; 32 at once json "
        + _ratio(_col(rounds, "b32", json32), _col(rounds, "b32-eager", json32))
        + f"; with every row's mask the free requests' TPOT beside constrained ones "
        f"{median_range(eager_tpot, '{:.1f}')} ms against {median_range(eager_alone, '{:.1f}')} "
        f"({_ratio(eager_tpot, eager_alone)})"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
