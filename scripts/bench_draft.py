"""Trained-draft benchmark: speed-up and acceptance against temperature and batch size.

    .venv/bin/python scripts/bench_draft.py --dtype bfloat16 --rounds 3 --out bench-draft/

Runs `specserve bench offline` on the chat workload (held out of the draft's training
prompts; or --workload grounded) for each temperature at batch 1, and greedy at 8 and
32 concurrent requests, with spec modes side by side in each invocation (--modes; none,
ngram, draft and hybrid by default, eagle and auto too), and prints one markdown table:
the median (range) over rounds of each mode's throughput relative to no speculation in
the same invocation, and the draft's acceptance.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from engine.benchmarks.report import median_range


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--quantization",
        default="none",
        help="the target's weights (default: dequantized, as the draft table was measured)",
    )
    parser.add_argument(
        "--workload", default="chat", help="chat (held out of training) or grounded"
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--temperatures", default="0,0.3,0.7,1.0")
    parser.add_argument("--concurrency", default="8,32", help="greedy runs at these batch sizes")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--draft-model", default=None, help="default: the shipped draft")
    parser.add_argument(
        "--eagle-draft", default=None, help="default: the shipped EAGLE draft (modes eagle, auto)"
    )
    parser.add_argument(
        "--modes",
        default="none,ngram,draft,hybrid",
        help="spec modes side by side in each invocation, none first (also: eagle, auto; "
        "MODE-nogate: that mode without the speculation gate)",
    )
    parser.add_argument(
        "--acceptance-of",
        default=None,
        help="the mode whose tokens/verification and acceptance the table shows "
        "(default: eagle if run, else draft)",
    )
    parser.add_argument("--out", default="bench-draft")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = [(float(t), 1, args.num_prompts) for t in args.temperatures.split(",") if t]
    cases += [(0.0, int(c), 2 * int(c)) for c in args.concurrency.split(",") if c]
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if modes[:1] != ("none",):
        parser.error("--modes must start with none (the baseline of every ratio)")
    shown = args.acceptance_of or ("eagle" if "eagle" in modes else "draft")
    rows = []
    for temperature, concurrency, num_prompts in cases:
        runs = []
        for r in range(args.rounds):
            tag = "-".join(modes[1:])
            name = f"{args.workload}-{args.dtype}-{tag}-t{temperature}-c{concurrency}-r{r}.json"
            path = out / name
            if not path.exists():
                _run(args, modes, temperature, concurrency, num_prompts, path)
            runs.append(json.loads(path.read_text())["results"])
        rows.append((temperature, concurrency, runs))
    print(_table(rows, f"{args.workload}, dtype {args.dtype}", modes, shown))
    return 0


def _run(args, modes, temperature: float, concurrency: int, num_prompts: int, path: Path) -> None:
    cmd = [sys.executable, "-m", "engine", "bench", "offline", "--workload", args.workload]
    cmd += ["--num-prompts", str(num_prompts), "--concurrency", str(concurrency)]
    cmd += ["--output-len", str(args.output_len), "--spec-modes", ",".join(modes)]
    cmd += ["--baselines", "none", "--temperature", str(temperature), "--dtype", args.dtype]
    cmd += ["--quantization", args.quantization]
    cmd += ["--json", str(path), "--no-progress"]
    if args.draft_model:
        cmd += ["--draft-model", args.draft_model]
    if args.eagle_draft:
        cmd += ["--eagle-draft", args.eagle_draft]
    print("+", " ".join(cmd[1:]), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def _table(rows, title: str, modes, shown: str) -> str:
    head = (
        "| temperature | batch | none tok/s | "
        + " | ".join(f"{m} vs none" for m in modes[1:])
        + f" | {shown}: tokens/verification | {shown}: acceptance by position |"
    )
    lines = [title, head, "|" + "---|" * (head.count("|") - 1)]
    for temperature, concurrency, runs in rows:
        by_mode = [{r["system"].split("spec: ")[1].rstrip(")"): r for r in run} for run in runs]
        base = [m["none"]["output_tokens_per_s"] for m in by_mode]
        cells = [f"{temperature:g}", str(concurrency), median_range(base, "{:.1f}")]
        for mode in modes[1:]:
            ratios = [
                m[mode]["output_tokens_per_s"] / m["none"]["output_tokens_per_s"] for m in by_mode
            ]
            cells.append(median_range(ratios, "{:.2f}x"))
        spec = by_mode[0].get(shown, {}).get("spec") or {}
        cells.append(f"{spec['tokens_per_verification']:.2f}" if spec else "-")
        positions = spec.get("acceptance_by_position") or []
        cells.append(" / ".join(f"{x:.2f}" for x in positions) if positions else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
