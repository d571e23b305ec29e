"""`specserve bench acceptance`: both verifications run on the same prompts and the
table reports each one's acceptance and their ratio."""

from __future__ import annotations

import re

from engine.entrypoints.cli import main


def test_bench_acceptance_reports_both_verifications(tiny_model_dir, tiny_draft_model_dir, capsys):
    argv = ["bench", "acceptance", "--model", tiny_model_dir, "--draft-model",
            tiny_draft_model_dir, "--device", "cpu", "--workload", "grounded",
            "--num-prompts", "4", "--output-len", "24", "--no-chat-template"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = {
        name: [float(x) for x in re.findall(r"\d+\.\d+", line)]
        for line in out.splitlines()
        for name in ("unseeded (rejection sampling)", "seeded (coupling)")
        if line.startswith(name)
    }
    assert len(rows) == 2
    for _accepted, per_token, tokens_per_verification in rows.values():
        assert 0 < per_token < 1 and tokens_per_verification > 1
    ratio = float(re.search(r"per-token acceptance: (\d+\.\d+)", out).group(1))
    unseeded, seeded = rows["unseeded (rejection sampling)"][1], rows["seeded (coupling)"][1]
    assert abs(ratio - seeded / unseeded) < 0.01


def test_bench_acceptance_needs_speculation(tiny_model_dir, capsys):
    argv = ["bench", "acceptance", "--model", tiny_model_dir, "--device", "cpu",
            "--speculative-method", "none"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["specserve bench: error: --speculative-method none has no drafts to accept"]
