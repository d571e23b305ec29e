"""The same end-to-end checks on every device this machine has.

On a CPU-only machine (CI) the CPU rows run and the CUDA rows are skipped for want of a
GPU; on a CUDA machine (`bash scripts/gpu_check.sh`, or `pytest -m gpu`) the CUDA rows
run the very same code: greedy engine output against transformers, n-gram and EAGLE
speculation against plain decoding, seeded sampling on the device, and token trees
(random ones, suffix decoding, n-gram trees, EAGLE trees) in batches that mix greedy,
seeded, penalized, biased, constrained and stop-string requests, against the plain
engine on the same device. (The attention backends' CUDA rows are in
test_attention.py.)
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


def _feature_requests(prompts: list[list[int]], k: int):
    """One of each kind users mix in a batch: greedy, seeded top-p, penalized, biased,
    constrained, stopped by a string; each with a fixed speculation budget ``k``."""
    from engine.io.sampling_params import SamplingParams, StructuredOutput

    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_p=0.9, seed=7),
        dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3),
        dict(temperature=1.0, seed=11, logit_bias={40: 3.0, 41: -100.0}),
        dict(temperature=0.0, structured_output=StructuredOutput(regex="[a-z ]{3,40}\\.")),
        dict(temperature=0.7, seed=3, stop=["e"], min_tokens=2),
    ]
    return [
        (f"f{i}", prompt, SamplingParams(max_tokens=24, ignore_eos=True,
                                         num_speculative_tokens=k, **kinds[i % len(kinds)]))
        for i, prompt in enumerate(prompts)
    ]  # fmt: skip


def _without_speculation(requests):
    from dataclasses import replace

    return [(r, p, replace(q, num_speculative_tokens=None)) for r, p, q in requests]


@pytest.mark.parametrize("device", DEVICES)
def test_random_trees_with_every_feature_equal_plain_decoding_on_the_device(tiny_model_dir, device):
    """Random token trees (tree attention on the device's backend, the accepted path's KV
    moved into place) in one batch with seeded, penalized, biased, constrained and
    stop-string requests: every output the plain engine's on the same device."""
    from tests.engine.test_token_trees import _repetitive_prompts, _tree_engine

    requests = _feature_requests(_repetitive_prompts(6, seed=21) * 2, k=6)
    plain = run_to_completion(
        make_engine(tiny_model_dir, device=device, num_kv_blocks=256),
        {0: _without_speculation(requests)},
    )
    engine, proposer = _tree_engine(tiny_model_dir, seed=23, device=device)
    trees = run_to_completion(engine, {0: requests})
    assert proposer.num_trees > 10 and proposer.num_moved > 0
    for request_id, _, _ in requests:
        assert trees[request_id]["token_ids"] == plain[request_id]["token_ids"], request_id
        assert trees[request_id]["text"] == plain[request_id]["text"], request_id
    assert_all_blocks_released(engine)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["suffix", "ngram-tree", "eagle-tree"])
def test_tree_proposers_with_every_feature_equal_plain_decoding_on_the_device(
    tiny_model_dir, close_eagle_targets, device, method
):
    """Each proposer that emits trees, on the device, beside every request kind."""
    from tests.engine.test_token_trees import _repetitive_prompts

    target, draft = (
        close_eagle_targets["float"] if method == "eagle-tree" else (tiny_model_dir, None)
    )
    prompts = _repetitive_prompts(6, seed=31) + prompts_of_lengths([14, 27], seed=33)
    requests = _feature_requests(prompts, k=4)
    plain = run_to_completion(
        make_engine(target, device=device, num_kv_blocks=256), {0: _without_speculation(requests)}
    )
    engine = make_engine(
        target, device=device, num_kv_blocks=256, speculative_method=method, draft_model=draft,
        speculative_disable_batch_size=64,
    )  # fmt: skip
    spec = run_to_completion(engine, {0: requests})
    assert engine.stats.num_draft_tokens > 0
    for request_id, _, _ in requests:
        assert spec[request_id]["token_ids"] == plain[request_id]["token_ids"], request_id
    assert_all_blocks_released(engine)
