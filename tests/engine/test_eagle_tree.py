"""EAGLE's dynamic token trees (``--speculative-method eagle-tree``): the draft's best
guesses expanded depth by depth, priced, verified in one forward by coupling.

What must hold: greedy output is transformers' token for token, and seeded output is
the same seed's without speculation, while the trees branch, are accepted and rejected,
and the accepted path's KV and features move into place; the tree forwards see only
each node's ancestors (a node's draft output equals the same path fed as a chain); no
draft block stays held."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.core.model_runner import SeqInput
from engine.io.sampling_params import SamplingParams
from engine.spec_decode.eagle_tree import TOP_K, EagleTreeProposer
from tests.engine.engine_helpers import (
    assert_all_blocks_released,
    hf_greedy,
    make_engine,
    prompts_of_lengths,
    run_to_completion,
)

# Requests ask for a fixed k and get their k best nodes (a tree wherever the draft's
# top guesses are close); adaptive k would seldom draft on the tiny models.
K = 8


def _engine(target, draft, **overrides):
    config = dict(
        speculative_method="eagle-tree",
        draft_model=draft,
        num_speculative_tokens=8,
        spec_tree_max_nodes=12,
        num_kv_blocks=256,
        speculative_disable_batch_size=64,
        seed=1,
    )
    config.update(overrides)
    engine = make_engine(target, **config)
    assert isinstance(engine.proposer, EagleTreeProposer)
    # the tiny draft costs a whole target step: priced as such, no tree grows past
    # depth 1; these tests are about what the trees do, so the draft is made free
    engine.proposer.cost_meter.cost = lambda *args: 0.0
    stats = {"trees": 0, "branching": 0, "moved": 0}
    propose = engine.proposer.propose

    def counted(items, states):
        trees, probs = propose(items, states)
        for tree in trees:
            if getattr(tree, "tokens", None):
                stats["trees"] += 1
                stats["branching"] += len(set(tree.parents)) < len(tree.parents)
        return trees, probs

    engine.proposer.propose = counted
    move_kv = engine.runner.move_kv

    def moved(src, dst):
        stats["moved"] += len(src)
        move_kv(src, dst)

    engine.runner.move_kv = moved
    return engine, stats


@pytest.mark.parametrize("kind", ["float", "gguf"])
def test_greedy_eagle_trees_match_transformers_token_for_token(close_eagle_targets, kind):
    target, draft = close_eagle_targets[kind]
    engine, stats = _engine(target, draft)
    prompts = prompts_of_lengths([5, 12, 23, 9], seed=3)
    params = SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True, num_speculative_tokens=K
    )
    results = run_to_completion(engine, {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]})
    float_target = close_eagle_targets["float"][0]
    for i, prompt in enumerate(prompts):
        want = hf_greedy(float_target, prompt, 40)
        if kind == "float":
            assert results[f"r{i}"]["token_ids"] == want, i
        else:  # a quantized target: the plain engine on the same .gguf is the reference
            plain = run_to_completion(
                make_engine(target, num_kv_blocks=256),
                {0: [("p", prompt, replace(params, num_speculative_tokens=None))]},
            )
            assert results[f"r{i}"]["token_ids"] == plain["p"]["token_ids"], i
    assert stats["trees"] >= 20 and stats["branching"] >= 10, stats
    assert 0 < engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens
    assert stats["moved"] > 0  # accepted paths off the first branch moved into place
    assert_all_blocks_released(engine)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_seeded_eagle_trees_equal_the_same_seed_without_speculation(close_eagle_targets, dtype):
    target, draft = close_eagle_targets["float"]
    prompts = prompts_of_lengths([7, 15, 4], seed=8)
    work = [
        (
            f"r{i}",
            p,
            SamplingParams(max_tokens=32, temperature=0.8, seed=40 + i, num_speculative_tokens=K),
        )
        for i, p in enumerate(prompts)
    ]
    engine, stats = _engine(target, draft, dtype=dtype)
    got = run_to_completion(engine, {0: work})
    plain_work = [(r, p, replace(q, num_speculative_tokens=None)) for r, p, q in work]
    plain = run_to_completion(make_engine(target, num_kv_blocks=256, dtype=dtype), {0: plain_work})
    for rid, _, _ in work:
        assert got[rid]["token_ids"] == plain[rid]["token_ids"], rid
    assert stats["branching"] > 0 and engine.stats.num_accepted_tokens > 0
    assert_all_blocks_released(engine)


def test_a_tree_node_sees_only_its_ancestors(close_eagle_targets):
    """The depth forwards' tree masks: a frontier node's draft logits are the same when
    its forward feeds only its ancestors and itself (siblings and cousins fed beside it
    change nothing), and a forward re-feeds the depths before it."""
    target, draft = close_eagle_targets["float"]
    engine, _ = _engine(target, draft, spec_tree_max_nodes=24)
    proposer = engine.proposer
    forward = proposer._forward
    checked = []

    def isolated(seqs, hidden):
        logits, out = forward(seqs, hidden)
        seq, h = seqs[0], hidden[0]
        if seq.tree_mask is None or len(seq.token_ids) < 3:
            return logits, out
        last = len(seq.token_ids) - 1
        path = [b for b in range(last + 1) if seq.tree_mask[last] >> b & 1]
        if len(path) == len(seq.token_ids):
            return logits, out
        alone = SeqInput([seq.token_ids[b] for b in path], seq.start_pos, seq.block_ids, 1)
        alone.positions = [seq.positions[b] for b in path]
        alone.tree_mask = [(1 << (j + 1)) - 1 for j in range(len(path))]  # a chain
        got, _ = forward([alone], [h[path]])
        row = seq.num_logits - 1  # the last node's row among the first seq's logits
        torch.testing.assert_close(got[0], logits[row], rtol=1e-5, atol=1e-5)
        checked.append((len(seq.token_ids), len(path)))
        return logits, out

    proposer._forward = isolated
    prompt = prompts_of_lengths([11], seed=5)[0]
    params = SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True, num_speculative_tokens=K
    )
    run_to_completion(engine, {0: [("r", prompt, params)]})
    assert checked, "no depth forward fed a node beside others"
    assert max(width for width, _ in checked) >= 2 * TOP_K  # a depth re-fed the ones before


def test_the_accepted_paths_features_move_with_it(close_eagle_targets):
    """The target's features for an accepted path off the first branch were computed
    in the nodes' slots; they must be where the next burst reads them: the drafts after
    a tree step equal those after the same tokens decoded plainly (checked through the
    greedy output staying exact and the draft's acceptance staying high)."""
    target, draft = close_eagle_targets["float"]
    engine, stats = _engine(target, draft)
    proposer = engine.proposer
    feats = {}
    original = proposer.on_accepted_nodes

    def spy(request_id, base, nodes):
        before = proposer._features[request_id].rows.clone()
        start = proposer._features[request_id].start
        original(request_id, base, nodes)
        after = proposer._features[request_id].rows
        for k, node in enumerate(nodes):
            assert torch.equal(after[base + k - start], before[base + node - start])
        feats[request_id] = feats.get(request_id, 0) + 1

    proposer.on_accepted_nodes = spy
    prompts = prompts_of_lengths([9, 14], seed=6)
    params = SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True, num_speculative_tokens=K
    )
    run_to_completion(engine, {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]})
    assert sum(feats.values()) > 0
    assert engine.stats.num_accepted_tokens / engine.stats.num_draft_tokens > 0.2


def test_fixed_k_requests_get_their_k_best_nodes(close_eagle_targets):
    target, draft = close_eagle_targets["float"]
    engine, _ = _engine(target, draft)
    sizes = []
    propose = engine.proposer.propose

    def sized(items, states):
        trees, probs = propose(items, states)
        sizes.extend(len(t.tokens) for t in trees if getattr(t, "tokens", None))
        return trees, probs

    engine.proposer.propose = sized
    prompt = prompts_of_lengths([10], seed=2)[0]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    fixed = replace(params, num_speculative_tokens=3)
    run_to_completion(engine, {0: [("r", prompt, fixed)]})
    assert sizes and max(sizes) <= 3
