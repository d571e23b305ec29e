"""Prompt lookup as token trees (NgramProposer.propose_tree_for): the last few
occurrences of the longest matching n-gram become branches, checked against a scan of
the whole context; one occurrence is propose_for's chain; the occurrence index grown a
few tokens at a time equals one built at once."""

from __future__ import annotations

import random

import pytest

from engine.spec_decode import paths
from engine.spec_decode.draft_tree import DraftTree
from engine.spec_decode.ngram import TREE_PSEUDO_COUNT, NgramProposer, _OccurrenceIndex


def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[k] for k in paths.node_path(tree.parents, i))
            for i in range(tree.num_nodes)}  # fmt: skip


def _check(tree: DraftTree, max_nodes: int, max_depth: int) -> None:
    tree.validate()  # topological, distinct siblings, scores in [0, 1] falling down paths
    assert tree.num_nodes <= max_nodes and tree.depth() <= max_depth


def _scan(tokens: list[int], ngram_min: int, ngram_max: int, limit: int, depth: int):
    """The reference: (n, what followed the last ``limit`` earlier occurrences of the
    longest n-gram ending the context, newest first), by looking at every window."""
    for n in range(min(ngram_max, len(tokens) - 1), ngram_min - 1, -1):
        suffix = tokens[-n:]
        starts = [j for j in range(len(tokens) - n) if tokens[j : j + n] == suffix]
        if starts:
            return n, [tokens[j + n : j + n + depth] for j in reversed(starts[-limit:])]
    return 0, []


@pytest.mark.parametrize("vocab, ngram_min, ngram_max", [(3, 1, 4), (5, 2, 3), (8, 1, 4)])
def test_every_occurrences_continuation_is_a_path(vocab, ngram_min, ngram_max):
    rng = random.Random(vocab * 10 + ngram_max)
    proposer = NgramProposer(ngram_min, ngram_max)
    tokens = [rng.randrange(vocab) for _ in range(5)]
    for _ in range(120):
        tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 4)))
        max_depth = rng.randint(1, 6)
        tree = proposer.propose_tree_for("r", tokens, 64, max_depth)
        _check(tree, 64, max_depth)
        n, continuations = _scan(tokens, ngram_min, ngram_max, 4, max_depth)
        assert n == proposer.propose_with_match(tokens, 1)[1]
        assert _paths(tree) == {tuple(c[:d]) for c in continuations for d in range(1, len(c) + 1)}


def test_one_occurrence_is_propose_fors_chain():
    """Growing random text, one occurrence kept per lookup: the tree is exactly the
    chain propose_for returns, at every length."""
    rng = random.Random(1)
    chains, trees = NgramProposer(1, 4), NgramProposer(1, 4)
    tokens = [rng.randrange(6) for _ in range(3)]
    for _ in range(150):
        tokens.extend(rng.randrange(6) for _ in range(rng.randint(1, 3)))
        max_nodes, max_depth = rng.randint(1, 8), rng.randint(1, 8)
        chain, n = chains.propose_for("r", tokens, min(max_nodes, max_depth))
        tree = trees.propose_tree_for("r", tokens, max_nodes, max_depth, max_occurrences=1)
        assert tree.tokens == chain and paths.is_chain(tree.parents)
        if n:  # a longer match is trusted more, and no guess is certain
            assert 0 < tree.scores[0] == pytest.approx(n / (n + TREE_PSEUDO_COUNT))
    # a context whose longest match occurred once: the chain, as propose_for has it
    tokens = [7, 1, 2, 3, 4, 5, 6, 9, 1, 8, 1, 9, 2, 3]
    tree = NgramProposer(1, 4).propose_tree_for("s", tokens, 8, 4)
    assert (tree.tokens, tree.parents) == ([4, 5, 6, 9], [-1, 0, 1, 2])
    assert tree.scores == pytest.approx([(2 / (2 + TREE_PSEUDO_COUNT)) ** d for d in range(1, 5)])


def test_agreeing_occurrences_share_a_path_and_the_frequent_branch_scores_higher():
    head = [1, 2, 3]
    tokens = []
    for k, follow in enumerate(([50, 51, 52], [60, 61, 62], [50, 51, 53], [50, 51, 52])):
        tokens += [100 + k, *head, *follow]
    tokens += [99, *head]
    tree = NgramProposer(1, 4).propose_tree_for("r", tokens, 32, 3)
    _check(tree, 32, 3)
    roots = {tree.tokens[i]: tree.scores[i] for i, p in enumerate(tree.parents) if p == -1}
    assert set(roots) == {50, 60} and roots[50] > roots[60]
    # 50 51 is one path for the three occurrences that start with it, then 52 or 53
    assert tree.tokens.count(50) == 1 and tree.tokens.count(51) == 1
    assert {(50, 51, 52), (50, 51, 53), (60, 61, 62)} <= _paths(tree)
    # the fifth occurrence back is not a branch
    older = [5, *head, 70] + tokens
    assert 70 not in NgramProposer(1, 4).propose_tree_for("s", older, 32, 3).tokens
    # max_nodes keeps the best: the frequent branch first
    assert NgramProposer(1, 4).propose_tree_for("t", tokens, 2, 3).tokens == [50, 51]


def test_the_longest_matching_n_wins():
    """The last token occurred often, the last three once: the three-gram's chain."""
    tokens = [4, 9, 5, 9, 6, 9, 7, 1, 2, 9, 8, 8, 8, 1, 2, 9]
    tree = NgramProposer(1, 4).propose_tree_for("r", tokens, 16, 4)
    assert tree.tokens == [8, 8, 8, 1] and paths.is_chain(tree.parents)


def test_short_and_empty_contexts_and_zero_budgets_propose_nothing():
    proposer = NgramProposer(1, 4)
    for tokens, max_nodes, max_depth in [
        ([], 8, 8), ([3], 8, 8), ([1, 2, 3, 4], 8, 8), ([1, 2, 1], 0, 8), ([1, 2, 1], 8, 0)
    ]:  # fmt: skip
        assert proposer.propose_tree_for("r", list(tokens), max_nodes, max_depth) == DraftTree()
    assert NgramProposer(2, 4).propose_tree_for("r", [5, 5], 8, 8) == DraftTree()


def test_the_occurrence_index_grown_equals_one_built_at_once():
    rng = random.Random(2)
    tokens: list[int] = []
    grown = _OccurrenceIndex(tokens, 1, 4)
    for _ in range(80):
        tokens.extend(rng.randrange(4) for _ in range(rng.randint(0, 6)))
        grown.extend()
    whole = _OccurrenceIndex(list(tokens), 1, 4)
    whole.extend()
    assert grown.last == whole.last and grown.previous == whole.previous


def test_a_growing_request_proposes_what_a_fresh_proposer_proposes():
    """The kept index against one rebuilt from scratch; a reused id with another list
    starts over, and propose_for is untouched by tree lookups on the same id."""
    rng = random.Random(3)
    kept = NgramProposer(1, 4)
    tokens = [rng.randrange(5) for _ in range(10)]
    for _ in range(60):
        tokens.extend(rng.randrange(5) for _ in range(rng.randint(1, 3)))
        assert kept.propose_tree_for("r", tokens, 12, 5) == NgramProposer(1, 4).propose_tree_for(
            "r", list(tokens), 12, 5
        )
        assert kept.propose_for("r", tokens, 3) == kept.propose_with_match(tokens, 3)
    other = [9, 8, 7, 9]
    assert kept.propose_tree_for("r", other, 4, 4).tokens == [8, 7, 9]
    kept.forget("r")
    assert "r" not in kept._tree_indexes and "r" not in kept._indexes
