"""bfloat16 vs float32 on CPU: the five commands of docs/benchmarks.md "bfloat16 on CPU".

    .venv/bin/python scripts/bench_bf16.py --rounds 5 --out bench-bf16/

Each round runs, one after another, `specserve bench offline` for: batch 1 (4 chat
prompts x 64 tokens) in fp32 and in bf16, each beside transformers `generate()` in the
same dtype; 32 requests x 64 tokens in bf16 beside transformers bf16, then in fp32; and
n-gram against no speculation on 4 grounded prompts at batch 1 in bf16. A finished run's
JSON is kept in --out and not rerun, so an interrupted series resumes. Prints one
markdown table: the median (range) over rounds, each ratio taken within one invocation
or, where it says "paired", between the two invocations of the same round.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from engine.benchmarks.report import median_range

# The dequantized weights (bf16 against fp32): scripts/bench_quant.py measures the
# .gguf served as stored.
BATCH1 = ["--num-prompts", "4", "--output-len", "64", "--concurrency", "1", "--spec-modes", "none"]
BATCH1 += ["--quantization", "none"]
BATCH32 = ["--num-prompts", "32", "--output-len", "64", "--spec-modes", "none"]
BATCH32 += ["--quantization", "none"]
RUNS = {
    "b1-fp32": [*BATCH1, "--baselines", "generate", "--dtype", "float32"],
    "b1-bf16": [*BATCH1, "--baselines", "generate", "--dtype", "bfloat16"],
    "b32-bf16": [*BATCH32, "--baselines", "generate", "--dtype", "bfloat16"],
    "b32-fp32": [*BATCH32, "--baselines", "none", "--dtype", "float32"],
    "grounded-bf16": [
        *["--workload", "grounded", "--num-prompts", "4", "--concurrency", "1"],
        *["--output-len", "64", "--spec-modes", "none,ngram", "--baselines", "none"],
        *["--dtype", "bfloat16"],
    ],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench-bf16")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rounds = []
    for r in range(args.rounds):
        results = {}
        for name, flags in RUNS.items():
            path = out / f"{name}-r{r}.json"
            if not path.exists():
                cmd = [sys.executable, "-m", "engine", "bench", "offline", *flags]
                cmd += ["--json", str(path), "--no-progress"]
                print(f"[round {r + 1}/{args.rounds}] + specserve bench offline", *flags,
                      file=sys.stderr, flush=True)  # fmt: skip
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            runs = json.loads(path.read_text())["results"]
            results[name] = {row["system"]: row["output_tokens_per_s"] for row in runs}
        rounds.append(results)
    print(_table(rounds))
    return 0


def _tok_s(results: dict, run: str, system: str) -> float:
    return next(v for k, v in results[run].items() if k.startswith(system))


def _table(rounds: list[dict]) -> str:
    ours, hf, ngram = "specserve (spec: none)", "hf generate()", "specserve (spec: ngram)"
    lines = [
        "| workload | specserve fp32 | specserve bf16 | transformers bf16 | "
        "bf16 / transformers bf16 | bf16 / our fp32 (paired) |",
        "|---|---|---|---|---|---|",
    ]
    for label, size in (("batch 1, chat, 4 x 64", "b1"), ("32 requests x 64", "b32")):
        fp32 = [_tok_s(r, f"{size}-fp32", ours) for r in rounds]
        bf16 = [_tok_s(r, f"{size}-bf16", ours) for r in rounds]
        base = [_tok_s(r, f"{size}-bf16", hf) for r in rounds]
        cells = [label, median_range(fp32, "{:.1f}"), median_range(bf16, "{:.1f}")]
        cells += [median_range(base, "{:.1f}")]
        cells += [median_range([a / b for a, b in zip(bf16, base)], "{:.2f}x")]
        cells += [median_range([a / b for a, b in zip(bf16, fp32)], "{:.2f}x")]
        lines.append("| " + " | ".join(cells) + " |")
    none = [_tok_s(r, "grounded-bf16", ours) for r in rounds]
    spec = [_tok_s(r, "grounded-bf16", ngram) for r in rounds]
    b1_fp32_hf = [_tok_s(r, "b1-fp32", hf) for r in rounds]
    lines.append(
        f"| batch 1, grounded, n-gram vs none | - | {median_range(spec, '{:.1f}')} vs "
        f"{median_range(none, '{:.1f}')} | - | - | n-gram "
        f"{median_range([a / b for a, b in zip(spec, none)], '{:.2f}x')} |"
    )
    b1_fp32 = [_tok_s(r, "b1-fp32", ours) for r in rounds]
    lines.append(
        f"\nfp32 batch 1 against transformers fp32 (same invocation): "
        f"{median_range([a / b for a, b in zip(b1_fp32, b1_fp32_hf)], '{:.2f}x')} "
        f"(transformers fp32 {median_range(b1_fp32_hf, '{:.1f}')} tok/s)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
