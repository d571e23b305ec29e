"""Prompt lookup: the scan (the reference) on hand-made contexts, and the per-request
index the proposers use, equal to the scan at every length of a growing sequence."""

from __future__ import annotations

import random

import pytest

from engine.spec_decode import ngram
from engine.spec_decode.ngram import NgramProposer


@pytest.mark.parametrize(
    "tokens, k, want",
    [
        ([1, 2, 3, 9, 1, 2], 3, ([3, 9, 1], 2)),  # the suffix 1 2 seen before: what followed
        ([1, 2, 3, 1, 2, 4, 1, 2], 2, ([4, 1], 2)),  # the most recent occurrence wins
        ([5, 1, 2, 3, 7, 6, 2, 3], 4, ([7, 6, 2, 3], 2)),  # longest suffix matched first
        ([7, 8, 9, 8], 2, ([9, 8], 1)),  # only one token matches
        ([1, 2, 3, 4], 3, ([], 0)),  # nothing repeats
        ([4, 4], 3, ([4], 1)),  # the continuation runs to the end of the context
        ([4], 3, ([], 0)),  # too short
        ([1, 2, 1, 2], 0, ([], 0)),  # k = 0
    ],
)
def test_lookup_proposes_what_followed_the_latest_longest_match(tokens, k, want):
    proposer = NgramProposer(1, 4)
    assert proposer.propose_with_match(tokens, k) == want
    assert proposer.propose_for("r", list(tokens), k) == want


@pytest.mark.parametrize(
    "ngram_min, ngram_max, vocab", [(1, 4, 4), (2, 3, 6), (1, 1, 3), (3, 5, 2)]
)
def test_the_index_equals_the_scan_at_every_length(ngram_min, ngram_max, vocab):
    """Tokens appended a few at a time (a step's accepted drafts and bonus token), a
    lookup between each: the kept index answers as the scan of the whole list does."""
    rng = random.Random(ngram_min * 100 + ngram_max * 10 + vocab)
    proposer = NgramProposer(ngram_min, ngram_max)
    lists = {f"r{i}": [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for i in range(3)}
    for _ in range(150):
        request_id = rng.choice(sorted(lists))
        tokens = lists[request_id]
        tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 5)))
        k = rng.randint(0, 6)
        assert proposer.propose_for(request_id, tokens, k) == proposer.propose_with_match(tokens, k)


def test_a_reused_id_or_a_shorter_list_starts_a_new_index():
    """An id cancelled and reused at once names a new token list; the old index would
    propose from the old request's context."""
    proposer = NgramProposer(1, 4)
    first = [1, 2, 3, 4, 1, 2]
    assert proposer.propose_for("id", first, 2) == ([3, 4], 2)
    second = [9, 8, 7, 1, 2]  # 1 2 never followed by 3 here
    assert proposer.propose_for("id", second, 2) == ([], 0)
    del first[3:]  # [1, 2, 3]: shorter than what was indexed
    assert proposer.propose_for("id", first, 2) == ([], 0)
    first.extend([1, 2])
    assert proposer.propose_for("id", first, 2) == ([3, 1], 2)


def test_indexes_beyond_the_cap_are_dropped_and_rebuilt(monkeypatch):
    monkeypatch.setattr(ngram, "MAX_INDEXED_REQUESTS", 4)
    proposer = NgramProposer(1, 4)
    lists = {f"r{i}": [i, 50, 51, i, 50] for i in range(10)}
    for request_id, tokens in lists.items():
        assert proposer.propose_for(request_id, tokens, 2) == ([51, tokens[0]], 2)
    assert len(proposer._indexes) == 4 and "r0" not in proposer._indexes
    lists["r0"].append(51)  # dropped, then asked again: rebuilt from the whole list
    assert proposer.propose_for("r0", lists["r0"], 3) == proposer.propose_with_match(lists["r0"], 3)
    proposer.forget("r0")
    assert "r0" not in proposer._indexes


def test_the_ngram_proposer_names_copied_spans_and_short_matches_apart():
    """Its sources are the speculation gate's lanes and the requests' acceptance
    histories: a match of LONG_MATCH tokens or more is "ngram", anything shorter (or
    nothing) "ngram-short"."""
    from types import SimpleNamespace

    from engine.spec_decode.proposers import LONG_MATCH, NgramSpecProposer

    proposer = NgramSpecProposer(1, 4)

    def source(tokens):
        return proposer.source_for(SimpleNamespace(request_id="r", all_token_ids=tokens))[0]

    span = list(range(10, 10 + LONG_MATCH))
    assert source([1, *span, 2, 3, *span]) == "ngram"
    assert source([1, *span[-2:], 2, 3, *span[-2:]]) == "ngram-short"
    assert source([1, 2, 3]) == "ngram-short"
    proposer.free("r")
