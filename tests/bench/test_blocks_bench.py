"""`specserve bench blocks`: the block manager micro-benchmark runs and reports."""

from __future__ import annotations

import json

import pytest

from engine.benchmarks import blocks


def test_bench_runs_and_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--num-requests", "16", "--steps", "20", "--warmup-steps", "5", "--json"]
    assert blocks.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["failed_allocations"] == 0
    assert result["step_ms_mean"] > 0 and result["prefix_hit_rate"] > 0
