"""`specserve bench offline` with trained drafts: hybrid and draft modes side by side,
sampled runs, and acceptance per draft position."""

from __future__ import annotations

import json

import pytest

from engine.benchmarks.offline import acceptance_by_position
from engine.entrypoints.cli import main


def test_acceptance_by_position_is_conditional_on_reaching_the_position():
    # (drafts, accepted): (3, 3) all kept, (3, 1) the second rejected, (2, 0) the first
    rates = acceptance_by_position([3, 3, 2], [3, 1, 0])
    assert rates == pytest.approx([2 / 3, 1 / 2, 1.0])
    assert acceptance_by_position([], []) == []


@pytest.mark.parametrize("every_prompt", [False, True])
def test_the_warm_up_leaves_no_prompt_cached(tiny_model_dir, every_prompt):
    """The GPU warm-up prefills every prompt once (each new shape loads kernels there),
    then empties the prefix cache, so the timed run's TTFT is not a cache hit."""
    from engine.benchmarks.offline import warm_up
    from tests.engine.engine_helpers import make_engine, prompts_of_lengths

    engine = make_engine(tiny_model_dir)
    prompts = prompts_of_lengths([40, 35, 50], seed=3)
    steps = []
    original = engine.step
    engine.step = lambda: steps.append(1) or original()
    warm_up(engine, prompts, 1, 16, every_prompt)
    pool = engine.kv_manager.pool
    # one prompt x 8 tokens; with every_prompt, three prompts x 2 tokens more
    assert len(steps) == (8 + 3 * 2 if every_prompt else 8)
    if every_prompt:
        assert len(pool.cached_blocks) == 0
    else:  # only the first prompt's full blocks stay cached
        assert len(pool.cached_blocks) == 40 // engine.config.block_size


def test_bench_offline_runs_hybrid_and_draft_modes_sampled(
    tiny_model_dir, tiny_trained_draft_dir, tmp_path
):
    out = tmp_path / "bench.json"
    argv = ["bench", "offline", "--model", tiny_model_dir, "--draft-model",
            tiny_trained_draft_dir, "--device", "cpu", "--num-prompts", "4",
            "--output-len", "16", "--concurrency", "1", "--spec-modes", "none,draft,hybrid",
            "--baselines", "none", "--temperature", "0.7", "--no-progress",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {f"specserve (spec: {m})" for m in ("none", "draft", "hybrid")}
    for mode in ("draft", "hybrid"):
        result = results[f"specserve (spec: {mode})"]
        assert result["num_output_tokens"] == 64
        positions = result["spec"]["acceptance_by_position"]
        assert positions and all(0.0 <= p <= 1.0 for p in positions)


def test_bench_offline_refuses_sampling_with_greedy_baselines(tiny_model_dir, capsys):
    argv = ["bench", "offline", "--model", tiny_model_dir, "--device", "cpu",
            "--temperature", "0.5"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "specserve bench: error: --temperature above 0 compares specserve runs only: "
        "add --baselines none"
    ]
