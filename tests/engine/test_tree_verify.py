"""Token trees are verified exactly: at each row the target's own sample picks the child
that holds it (coupling), so each output token is distributed as plain decoding would
sample it after the tokens before it, whatever the tree and whatever the request kind.

The target here is synthetic: each row's distribution is a function of the draft path
before it (``_target``), so a verifier that read the wrong row, or kept a child the
sample did not pick, would sample the wrong conditional distribution.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from engine.io.sampling_params import SamplingParams
from engine.spec_decode import paths
from engine.spec_decode.verifier import Verifier
from scheduler.output import ScheduledRequest, SchedulerOutput

V = 8
NUM_REQUESTS = 6000

#        root
#       / |  \
#      2  5   7
#     / \  \
#    3   5  1
#        |
#        6
TOKENS = [2, 5, 7, 3, 5, 1, 6]
PARENTS = [-1, -1, -1, 0, 0, 1, 4]


def _target(prefix: tuple[int, ...]) -> torch.Tensor:
    """[V] probabilities after ``prefix``: different for every path, every token
    possible, the tree's tokens likely enough to be kept and rejected often."""
    g = torch.Generator().manual_seed(hash(prefix) % (2**31))
    weights = torch.rand(V, generator=g) + 0.05
    weights[[2, 5, 6]] += 0.6
    return weights / weights.sum()


def _rows(tokens, parents) -> torch.Tensor:
    """[1 + N, V] logits: the target after each row's path."""
    return torch.stack([_target(tuple(p)).log() for p in paths.row_prefixes(tokens, parents)])


def _items(num: int, tokens, parents, **params):
    items, states = [], []
    for i in range(num):
        item = ScheduledRequest(f"r{i}", 10, 1 + len(tokens), [1], True, len(tokens))
        item.spec_token_ids, item.spec_parents = list(tokens), parents
        items.append(item)
        states.append(
            SimpleNamespace(
                params=SamplingParams(max_tokens=16, ignore_eos=True, **params),
                request=SimpleNamespace(num_tokens=10, num_output_tokens=0),
            )
        )
    return items, states


def _verify(num, tokens, parents, seed=0, **params):
    items, states = _items(num, tokens, parents, **params)
    logits = _rows(tokens, parents).repeat(num, 1)
    verifier = Verifier(torch.device("cpu"), seed)
    return verifier.verify(
        logits,
        SchedulerOutput(items, 0),
        states,
        [list(tokens)] * num,
        {},
        None,
        [parents] * num,
    )


def _tv(samples: list[int], expected: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=V).double() / len(samples)
    return 0.5 * float((counts - expected.double()).abs().sum())


def test_paths_walk_keeps_the_child_holding_each_sample():
    # samples per row: root row says 2 (node 0), node 0's row says 5 (node 4), node 4's
    # row says 6 (node 6), node 6's row says 3: the bonus
    samples = [2, 0, 0, 0, 0, 6, 0, 3]
    samples[1] = 5  # row of node 0
    assert paths.walk(TOKENS, PARENTS, samples) == ([2, 5, 6, 3], [0, 4, 6])
    assert paths.walk(TOKENS, PARENTS, [4, *[0] * 7]) == ([4], [])
    assert paths.accepted_rows([0, 4, 6]) == [0, 1, 5, 7]


def test_ancestor_masks_see_the_path_only():
    masks = paths.ancestor_masks(PARENTS, 1, len(TOKENS))
    assert masks[0] == 0b1
    for i in range(len(TOKENS)):
        seen = {b - 1 for b in range(1, 8) if masks[1 + i] >> b & 1}
        assert seen == set(paths.node_path(PARENTS, i)), i
        assert masks[1 + i] & 1  # the root
    # two verified tokens before the tree: both seen by every node
    assert all(m & 0b11 == 0b11 for m in paths.ancestor_masks(PARENTS, 2, 7)[1:])


def test_keep_nodes_drops_subtrees_and_reindexes():
    keep = [True, False, True, True, True, False, True]
    tokens, parents = paths.keep_nodes(TOKENS, PARENTS, keep)
    assert tokens == [2, 7, 3, 5, 6]
    assert parents == [-1, -1, 0, 0, 3]
    with pytest.raises(ValueError, match="parent"):
        paths.keep_nodes(TOKENS, PARENTS, [False, True, True, True, True, True, True])
    assert paths.keep_nodes(TOKENS, PARENTS, [True, False, False, False, True, False, True]) == (
        [2, 5, 6],
        None,
    )


def test_greedy_tree_verification_follows_the_argmax_path():
    out = _verify(3, TOKENS, PARENTS, temperature=0.0)
    expected, row, nodes = [], 0, []
    prefixes = paths.row_prefixes(TOKENS, PARENTS)
    while True:
        token = int(_target(tuple(prefixes[row])).argmax())
        expected.append(token)
        children = [i for i, p in enumerate(PARENTS) if p == row - 1 and TOKENS[i] == token]
        if not children:
            break
        nodes.append(children[0])
        row = children[0] + 1
    for i in range(3):
        assert out.sampled_token_ids[f"r{i}"] == expected
        assert out.accepted_nodes[f"r{i}"] == nodes


@pytest.mark.parametrize("seeded", [False, True], ids=["engine-noise", "seeded"])
def test_sampled_tree_outputs_follow_the_target_conditionals(seeded):
    """The first token follows the root's distribution; given a first token that is a
    child of the root, the second follows that child's row; given the path 2, 5 the
    third follows node 4's row: at temperature 1 and 0.7, unseeded (noise from the
    engine's generator) and seeded (each request its own seed)."""
    for temperature in (1.0, 0.7):
        if seeded:
            outs = {}
            for i in range(NUM_REQUESTS // 500):
                out = _verify(500, TOKENS, PARENTS, seed=i, temperature=temperature)
                outs.update({f"{i}-{k}": v for k, v in out.sampled_token_ids.items()})
            sequences = list(outs.values())
        else:
            out = _verify(NUM_REQUESTS, TOKENS, PARENTS, seed=3, temperature=temperature)
            sequences = list(out.sampled_token_ids.values())

        def expected(prefix, temperature=temperature):
            p = _target(prefix) ** (1 / temperature)
            return p / p.sum()

        assert _tv([s[0] for s in sequences], expected(())) < 0.03
        for first in (2, 5):
            seconds = [s[1] for s in sequences if s[0] == first]
            assert len(seconds) > 300
            assert _tv(seconds, expected((first,))) < 0.07, (first, temperature)
        thirds = [s[2] for s in sequences if s[:2] == [2, 5]]
        assert len(thirds) > 100
        assert _tv(thirds, expected((2, 5))) < 0.12
        # a first token that is no child of the root ends the output there
        assert all(len(s) == 1 for s in sequences if s[0] not in (2, 5, 7))


def test_seeded_tree_outputs_equal_the_same_seed_without_drafts():
    """Coupling: a seeded request's tokens are its own samples at each position, so a
    tree changes how many come per step, never which."""
    rng = random.Random(0)
    for trial in range(40):
        seed = rng.randrange(1 << 30)
        params = {"temperature": 1.0}
        items, states = _items(1, TOKENS, PARENTS, **params)
        states[0].params = SamplingParams(max_tokens=16, ignore_eos=True, seed=seed, **params)
        logits = _rows(TOKENS, PARENTS)
        verifier = Verifier(torch.device("cpu"), trial)
        out = verifier.verify(
            logits, SchedulerOutput(items, 0), states, [TOKENS], {}, None, [PARENTS]
        ).sampled_token_ids["r0"]
        # the same seed, one position at a time along the output's own path
        plain = []
        for j in range(len(out)):
            item = ScheduledRequest("r0", 10 + j, 1, [1], True, 0)
            state = SimpleNamespace(
                params=SamplingParams(max_tokens=16, ignore_eos=True, seed=seed, **params),
                request=SimpleNamespace(num_tokens=10 + j, num_output_tokens=j),
            )
            row = _target(tuple(out[:j])).log().unsqueeze(0)
            one = Verifier(torch.device("cpu"), 99).verify(
                row, SchedulerOutput([item], 0), [state], [[]], {}
            )
            plain.append(one.sampled_token_ids["r0"][0])
        assert out == plain, (seed, out, plain)


def test_logprobs_come_from_the_accepted_rows():
    out = _verify(1, TOKENS, PARENTS, temperature=0.0, logprobs=1)
    tokens = out.sampled_token_ids["r0"]
    rows = paths.accepted_rows(out.accepted_nodes["r0"])
    logits = _rows(TOKENS, PARENTS)
    for entry, token, row in zip(out.logprobs["r0"], tokens, rows):
        expected = torch.log_softmax(logits[row], -1)[token]
        assert entry.logprob == pytest.approx(float(expected), abs=1e-5)
