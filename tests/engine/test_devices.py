"""The same end-to-end checks on every device this machine has.

On a CPU-only machine (CI) the CPU rows run and the CUDA rows are skipped for want of a
GPU; on a CUDA machine (`bash scripts/gpu_check.sh`, or `pytest -m gpu`) the CUDA rows
run the very same code: greedy engine output against transformers, n-gram speculation
against plain decoding, and seeded sampling on the device. (The attention backends'
CUDA rows are in test_attention.py.)
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.engine_helpers import (
    GPU_ONLY,
    assert_all_blocks_released,
    greedy,
    hf_greedy,
    make_engine,
    prompts_of_lengths,
    run_to_completion,
)

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", marks=GPU_ONLY)]


@pytest.fixture(autouse=True)
def _exact_fp32_matmuls():
    """TF32 would make CUDA fp32 greedy comparisons meaningless."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("device", DEVICES)
def test_engine_greedy_matches_transformers(tiny_model_dir, device):
    """fp32 on the device, continuous batching with staggered arrivals, against
    transformers' greedy generate() on the CPU."""
    engine = make_engine(tiny_model_dir, device=device, dtype="float32")
    prompts = prompts_of_lengths([3, 17, 9, 30], seed=5)
    arrivals = {2 * i: [(f"d{i}", p, greedy(10))] for i, p in enumerate(prompts)}
    results = run_to_completion(engine, arrivals)
    for i, prompt in enumerate(prompts):
        assert results[f"d{i}"]["token_ids"] == hf_greedy(tiny_model_dir, prompt, 10)
    assert_all_blocks_released(engine)


@pytest.mark.parametrize("device", DEVICES)
def test_ngram_speculation_equals_plain_decoding(tiny_model_dir, device):
    prompts = prompts_of_lengths([12, 25], seed=9)
    prompts.append(prompts[0][:6] * 5)  # repetitive: n-gram drafts get accepted
    work = {0: [(f"s{i}", p, greedy(16)) for i, p in enumerate(prompts)]}
    plain = run_to_completion(make_engine(tiny_model_dir, device=device, dtype="float32"), work)
    engine = make_engine(
        tiny_model_dir,
        device=device,
        dtype="float32",
        speculative_method="ngram",
        speculative_disable_batch_size=64,
    )
    spec = run_to_completion(engine, work)
    for request_id, ref in plain.items():
        assert spec[request_id]["token_ids"] == ref["token_ids"], request_id
    assert engine.stats.num_draft_tokens > 0
    assert_all_blocks_released(engine)


@pytest.mark.parametrize("device", DEVICES)
def test_eagle_speculation_equals_plain_decoding(close_eagle_targets, device):
    """An EAGLE draft on the device (its features captured from the target's forward,
    its paged cache on the device's attention backend), mostly accepted."""
    target, draft = close_eagle_targets["float"]
    prompts = prompts_of_lengths([12, 25, 40], seed=9)
    work = {0: [(f"e{i}", p, greedy(24)) for i, p in enumerate(prompts)]}
    plain = run_to_completion(make_engine(target, device=device, dtype="float32"), work)
    engine = make_engine(
        target, device=device, dtype="float32", speculative_method="eagle",
        draft_model=draft, speculative_disable_batch_size=64,
    )  # fmt: skip
    spec = run_to_completion(engine, work)
    for request_id, ref in plain.items():
        assert spec[request_id]["token_ids"] == ref["token_ids"], request_id
    assert engine.stats.num_accepted_tokens > 0
    assert_all_blocks_released(engine)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_is_reproducible_on_the_device(tiny_model_dir, device):
    from engine.io.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=123, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = make_engine(tiny_model_dir, device=device, dtype="float32")
        runs.append(run_to_completion(engine, {0: [("x", [5, 6, 7, 8], params)]}))
    assert runs[0]["x"]["token_ids"] == runs[1]["x"]["token_ids"]
    assert len(runs[0]["x"]["token_ids"]) == 12
