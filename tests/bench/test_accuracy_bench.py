"""`specserve bench accuracy` on a tiny quantized .gguf: every variant gets a row, the
reference agrees with itself, and quantizing costs a little, not a lot."""

from __future__ import annotations

import json
import math

from engine.entrypoints.cli import main


def test_bench_accuracy_reports_every_variant(tiny_gguf_path, tmp_path, capsys):
    out = tmp_path / "accuracy.json"
    argv = ["bench", "accuracy", "--model", tiny_gguf_path, "--num-passages", "3"]
    argv += ["--max-tokens", "48", "--num-chat-prompts", "2", "--greedy-tokens", "12"]
    variants = "float32:none,float32:auto,bfloat16:auto,float32:int8,float32:none:bf16kv"
    argv += ["--variants", variants]
    argv += ["--json", str(out)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "| variant | perplexity | mean KL vs reference" in table
    rows = {row["variant"]: row for row in json.loads(out.read_text())}
    assert list(rows) == [
        "float32:none", "float32:auto", "bfloat16:auto", "float32:int8", "float32:none:bf16kv"
    ]  # fmt: skip
    same = rows["float32:none"]  # the reference itself: nothing differs
    assert same["mean_kl"] < 1e-9 and same["top1_agreement"] == 1.0
    for name in ("float32:auto", "bfloat16:auto", "float32:int8", "float32:none:bf16kv"):
        row = rows[name]
        assert 0 < row["mean_kl"] < 0.05, (name, row)
        assert row["top1_agreement"] > 0.7, (name, row)
        assert math.isfinite(row["perplexity"]) and row["perplexity"] > 1
        assert abs(math.log(row["perplexity"] / same["perplexity"])) < 0.1


def test_bench_accuracy_refuses_a_bad_variant(capsys):
    assert main(["bench", "accuracy", "--variants", "float32:q4"]) == 2
    assert "--variants: 'float32:q4' must be DTYPE:QUANTIZATION" in capsys.readouterr().err
    assert main(["bench", "accuracy", "--variants", "bfloat16:none:bf16kv"]) == 2
    assert "(bf16kv: float32 only)" in capsys.readouterr().err
