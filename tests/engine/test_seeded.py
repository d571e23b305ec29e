"""The seeded contract: a seeded request's output is a function of model, prompt,
parameters and seed only. The same alone or in any batch, with any speculation length,
draft model or n-gram drafts or none, under preemption and chunked prefill, whatever
the engine's own seed. That it is still an exact sample of the target:
tests/engine/test_lossless_sampling.py."""

from __future__ import annotations

import pytest

from engine.io.sampling_params import SamplingParams
from engine.sample.sampler import position_seed
from tests.engine.engine_helpers import (
    assert_all_blocks_released,
    make_engine,
    prompts_of_lengths,
    run_to_completion,
    spec_kwargs,
)


def _seeded(seed: int, k: int | None = None, **kw) -> SamplingParams:
    # Low temperatures too: near-greedy text repeats itself, so drafts get accepted.
    temperature = (0.05, 0.7, 1.0, 0.2)[seed % 4]
    kw = {"max_tokens": 24, "temperature": temperature, "ignore_eos": True, **kw}
    return SamplingParams(seed=seed, num_speculative_tokens=k, **kw)


def _prompts() -> list[list[int]]:
    # A repetitive prompt too, so n-gram lookup proposes drafts.
    return prompts_of_lengths([12, 30, 5], seed=21) + [prompts_of_lengths([4], seed=22)[0] * 8]


def _alone(model_dir) -> dict[str, list[int]]:
    """Each seeded request alone in an engine without speculation."""
    out = {}
    for i, prompt in enumerate(_prompts()):
        engine = make_engine(model_dir, seed=99)
        result = run_to_completion(engine, {0: [(f"s{i}", prompt, _seeded(100 + i))]})
        out[f"s{i}"] = result[f"s{i}"]["token_ids"]
    return out


def _crowd(k: int | None) -> dict[int, list]:
    """The seeded requests arriving at different steps among unseeded, greedy and
    top-p/min-p requests."""
    others = prompts_of_lengths([7, 19, 40, 3], seed=23)
    crowd = {
        0: [("u0", others[0], SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True))],
        1: [("g0", others[1], SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True))],
        4: [("u1", others[2], SamplingParams(max_tokens=30, temperature=0.9, top_p=0.8))],
        6: [("m0", others[3], SamplingParams(max_tokens=12, temperature=1.2, min_p=0.1))],
    }
    for i, prompt in enumerate(_prompts()):
        crowd.setdefault(2 * i, []).append((f"s{i}", prompt, _seeded(100 + i, k)))
    return crowd


@pytest.mark.parametrize(
    ("method", "engine_kwargs"),
    [
        ("none", {}),
        ("ngram", {}),
        ("ngram", {"max_num_batched_tokens": 24}),  # chunked prefill
        ("ngram", {"num_kv_blocks": 12}),  # preemption
        ("draft", {}),
        ("draft", {"max_num_batched_tokens": 24, "num_kv_blocks": 14}),
        ("hybrid", {}),
        ("hybrid", {"max_num_batched_tokens": 24, "num_kv_blocks": 14}),
        ("eagle", {}),
        ("eagle", {"max_num_batched_tokens": 24, "num_kv_blocks": 14}),
        ("hybrid", {"draft": "eagle"}),
    ],
)
def test_a_seeded_request_is_the_same_alone_in_a_crowd_and_with_any_speculation(
    tiny_model_dir, spec_draft_dirs, method, engine_kwargs
):
    alone = _alone(tiny_model_dir)
    kwargs = spec_kwargs(method, engine_kwargs, spec_draft_dirs)
    kwargs.update(speculative_disable_batch_size=64, seed=7)
    engine = make_engine(tiny_model_dir, **kwargs)
    accepted = 0
    for k in (None, 1, 3):
        if method == "none" and k:
            continue
        results = run_to_completion(engine, _crowd(k))
        for request_id, tokens in alone.items():
            assert results[request_id]["token_ids"] == tokens, (k, request_id)
            accepted += results[request_id]["metrics"].num_accepted_tokens
        assert_all_blocks_released(engine)
    if method != "none":
        # the coupling's accept path ran, not only its first-mismatch path
        assert accepted > 0


def test_seeded_output_ignores_the_engine_seed_and_adaptive_k(tiny_model_dir):
    prompt = _prompts()[3]
    outputs = set()
    for engine_seed, k in ((0, None), (1, None), (2, 2), (3, 0)):
        engine = make_engine(tiny_model_dir, speculative_method="ngram", seed=engine_seed)
        result = run_to_completion(engine, {0: [("x", prompt, _seeded(5, k))]})
        outputs.add(tuple(result["x"]["token_ids"]))
    assert len(outputs) == 1


def test_different_seeds_and_positions_draw_different_noise():
    seeds = {position_seed(s, p) for s in range(50) for p in range(50)}
    assert len(seeds) == 2500
    assert all(0 <= s < 2**64 for s in seeds)
