"""Token trees through the whole engine: random trees (tests/engine/tree_helpers.py) are
verified in one forward with tree attention, the accepted path's KV moved into place,
and every output is what plain decoding gives: greedy token for token against
transformers, seeded ones against the same seed without speculation, constrained ones
against the plain engine, in float32 and bfloat16, beside chains and plain rows."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from engine.io.sampling_params import SamplingParams, StructuredOutput
from tests.engine.engine_helpers import (
    assert_all_blocks_released,
    hf_greedy,
    make_engine,
    prompts_of_lengths,
    run_to_completion,
)
from tests.engine.tree_helpers import install_tree_proposer


def _repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts whose continuations repeat them often, so n-gram guesses (the path the
    random trees are built around) are kept and the trees' later branches get used."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        unit = [rng.randrange(3, 200) for _ in range(rng.randint(2, 5))]
        out.append(unit * rng.randint(3, 6))
    return out


def _tree_engine(model_dir, seed: int = 0, **overrides):
    config = dict(
        speculative_method="ngram",
        num_speculative_tokens=6,
        num_kv_blocks=256,
        speculative_disable_batch_size=64,
    )
    config.update(overrides)
    engine = make_engine(model_dir, **config)
    proposer = install_tree_proposer(engine, seed)
    move_kv = engine.runner.move_kv
    proposer.num_moved = 0

    def counted(src, dst):  # accepted nodes that were not where their depth sits
        proposer.num_moved += len(src)
        move_kv(src, dst)

    engine.runner.move_kv = counted
    return engine, proposer


def test_greedy_trees_match_transformers_token_for_token(tiny_model_dir):
    engine, proposer = _tree_engine(tiny_model_dir, spec_tree_max_nodes=12)
    # (prompts whose greedy continuation never reaches EOS: transformers' min_new_tokens
    # suppresses it, the engine's ignore_eos does not)
    prompts = _repetitive_prompts(6, seed=1)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True) for _ in prompts]
    params[-1] = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                num_speculative_tokens=0)  # fmt: skip
    arrivals = {0: [(f"r{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params))]}
    results = run_to_completion(engine, arrivals)
    assert proposer.num_trees > 20
    assert engine.stats.num_accepted_tokens > 20
    assert proposer.num_moved > 10  # later branches kept: their KV moved into place
    for i, prompt in enumerate(prompts):
        assert results[f"r{i}"]["token_ids"] == hf_greedy(tiny_model_dir, prompt, 40), i
    assert_all_blocks_released(engine)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_seeded_and_greedy_trees_equal_plain_decoding(tiny_model_dir, tiny_gguf_path, dtype):
    """The same requests in a plain engine and in one verifying random trees (the float
    model and the quantized .gguf): every greedy and seeded output identical."""
    rng = random.Random(5)
    prompts = _repetitive_prompts(6, seed=7) + prompts_of_lengths([12, 21], seed=9)
    requests = []
    for i, prompt in enumerate(prompts):
        # a fixed k: trees of 6 nodes every step, whatever adaptive k makes of the timing
        if i % 2:
            params = SamplingParams(
                max_tokens=30, temperature=0.0, ignore_eos=True, num_speculative_tokens=6
            )
        else:
            temperature, seed = rng.choice([0.7, 1.0]), rng.randrange(1 << 30)
            params = SamplingParams(
                max_tokens=30, temperature=temperature, top_p=0.9, seed=seed, ignore_eos=True,
                num_speculative_tokens=6,
            )  # fmt: skip
        requests.append((f"r{i}", prompt, params))
    for target in (tiny_model_dir, tiny_gguf_path):
        unspeculated = [(r, p, replace(q, num_speculative_tokens=None)) for r, p, q in requests]
        plain = run_to_completion(
            make_engine(target, dtype=dtype, num_kv_blocks=256), {0: unspeculated}
        )
        engine, proposer = _tree_engine(target, seed=11, dtype=dtype)
        trees = run_to_completion(engine, {0: requests})
        assert proposer.num_trees > 10 and proposer.num_moved > 5
        for request_id, _, _ in requests:
            assert trees[request_id]["token_ids"] == plain[request_id]["token_ids"], request_id
        assert_all_blocks_released(engine)


def test_constrained_trees_equal_the_plain_engine(tiny_model_dir):
    """A constraint prunes the nodes it refuses (and everything below them); the rest
    is masked per node; output equal to the plain engine's."""
    constraints = [
        StructuredOutput(regex="[a-z ]{3,40}\\."),
        StructuredOutput(choice=("yes", "no", "maybe so")),
        StructuredOutput(grammar='start: "id-" /[0-9]{2,6}/'),
    ]
    prompts = _repetitive_prompts(6, seed=13)
    requests = [
        (f"r{i}", p, SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.8,
                                    seed=i, structured_output=constraints[i % 3]))
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    plain = run_to_completion(make_engine(tiny_model_dir, num_kv_blocks=256), {0: requests})
    engine, proposer = _tree_engine(tiny_model_dir, seed=17)
    trees = run_to_completion(engine, {0: requests})
    assert proposer.num_trees > 5
    for request_id, _, _ in requests:
        assert trees[request_id]["token_ids"] == plain[request_id]["token_ids"], request_id
        assert trees[request_id]["text"] == plain[request_id]["text"]
