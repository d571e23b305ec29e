"""Suffix decoding (engine/spec_decode/suffix.py) and its proposer's pricing
(engine/spec_decode/tree_proposer.py): valid trees that hold what followed each match,
scores that fall down every path, the cache of recent answers scoped by caller and
bounded in memory, and trees priced to what pays."""

from __future__ import annotations

import random
import tracemalloc
from types import SimpleNamespace

import pytest

from engine.spec_decode import paths
from engine.spec_decode.draft_tree import DraftTree
from engine.spec_decode.suffix import BYTES_PER_KEY, BYTES_PER_TOKEN, SuffixDecoder, SuffixText
from engine.spec_decode.tree_proposer import SuffixSpecProposer, price_tree


def _check(tree: DraftTree) -> None:
    tree.validate()
    for i, parent in enumerate(tree.parents):
        assert 0 <= tree.scores[i] <= (tree.scores[parent] if parent >= 0 else 1.0)


def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[k] for k in paths.node_path(tree.parents, i))
            for i in range(tree.num_nodes)}  # fmt: skip


def test_the_requests_own_text_is_continued_where_it_repeats():
    rng = random.Random(0)
    unit = [rng.randrange(1000) for _ in range(12)]
    tokens = unit * 3 + unit[:5]
    tree = SuffixDecoder().propose("r", tokens, None, max_nodes=16, max_depth=8)
    _check(tree)
    assert tuple(unit[5:13]) in _paths(tree) or tuple(unit[5:12] + unit[:1]) in _paths(tree)


def test_branches_follow_how_often_each_continuation_came():
    """The context's tail occurred 3 times followed by A and once by B: both are
    branches, A's first node scored higher."""
    head = [1, 2, 3, 4]
    tokens = []
    for k, follow in enumerate(([50, 51, 52], [50, 51, 52], [60, 61], [50, 51, 52])):
        tokens += [100 + k] + head + follow  # a distinct token before each: equal matches
    tokens += [999] + head
    tree = SuffixDecoder().propose("r", tokens, None, max_nodes=16, max_depth=4)
    _check(tree)
    roots = {tree.tokens[i]: tree.scores[i] for i, p in enumerate(tree.parents) if p == -1}
    assert set(roots) == {50, 60}
    assert roots[50] > roots[60]
    assert (50, 51, 52) in _paths(tree) and (60, 61) in _paths(tree)


def test_max_nodes_max_depth_and_short_contexts():
    rng = random.Random(1)
    tokens = [rng.randrange(30) for _ in range(400)]
    decoder = SuffixDecoder()
    for max_nodes, max_depth in [(1, 1), (5, 2), (24, 6)]:
        tree = decoder.propose("r", tokens, None, max_nodes, max_depth)
        _check(tree)
        assert tree.num_nodes <= max_nodes and tree.depth() <= max_depth
    assert decoder.propose("s", [5], None, 8, 8).num_nodes == 0
    assert decoder.propose("t", [], None, 8, 8).num_nodes == 0
    assert decoder.propose("u", [1, 2, 3], None, 8, 8).num_nodes == 0  # nothing repeats


def test_a_longer_match_allows_a_larger_tree():
    rng = random.Random(2)
    answer = [rng.randrange(1000) for _ in range(80)]
    decoder = SuffixDecoder(alpha=2.0)
    decoder.add_finished(answer, None)
    short = decoder.propose("a", [7, 7, 7, 7, *answer[20:24]], None, 60, 60)
    long = decoder.propose("b", [7, 7, *answer[4:24]], None, 60, 60)
    assert short.num_nodes == 8  # 2 x a 4-token match
    assert long.num_nodes == 40  # 2 x 20
    assert long.tokens[:40] == answer[24:64]


def test_incremental_index_equals_one_built_at_once():
    """Tokens appended a few at a time (a request's own list, and a cache's array)
    index as they would all at once."""
    rng = random.Random(3)
    grown, tokens = SuffixText(), []
    own = SuffixText(tokens)
    for _ in range(50):
        more = [rng.randrange(6) for _ in range(rng.randint(0, 9))]
        tokens += more
        grown.extend(more)
        own.index_to(len(tokens) - rng.randint(0, 1))
    own.index_to(len(tokens))
    whole = SuffixText()
    whole.extend(tokens)
    for text in (grown, own):
        assert text.last == whole.last and text.links == whole.links
        assert text.length == len(tokens)


def test_a_growing_request_proposes_what_a_fresh_decoder_proposes():
    rng = random.Random(4)
    tokens = [rng.randrange(8) for _ in range(30)]
    decoder = SuffixDecoder()
    for _ in range(40):
        tokens.append(rng.randrange(8))
        kept = decoder.propose("r", tokens, None, 12, 6)
        fresh = SuffixDecoder().propose("r", list(tokens), None, 12, 6)
        assert (kept.tokens, kept.parents) == (fresh.tokens, fresh.parents)


def test_a_scopes_answers_are_never_proposed_to_another_scope():
    rng = random.Random(5)
    secret = [rng.randrange(1000) for _ in range(40)]
    decoder = SuffixDecoder()
    decoder.add_finished(secret, "key-aaaa")
    context = [3, 3, *secret[:10]]
    assert decoder.propose("mine", context, "key-aaaa", 16, 16).tokens[:5] == secret[10:15]
    assert decoder.propose("theirs", context, "key-bbbb", 16, 16).num_nodes == 0
    assert decoder.propose("anon", context, None, 16, 16).num_nodes == 0


def test_the_cache_stays_under_its_memory_cap_oldest_out_first():
    rng = random.Random(6)
    cap = 300 * (BYTES_PER_TOKEN + 2 * BYTES_PER_KEY)  # about 300 tokens of distinct text
    decoder = SuffixDecoder(max_cache_bytes=cap)
    answers = [[rng.randrange(10_000) for _ in range(50)] for _ in range(40)]
    for i, answer in enumerate(answers):
        decoder.add_finished(answer, f"s{i % 3}")
        assert decoder.cache_bytes <= cap
        assert decoder.cache_bytes == _recount(decoder)
    # the newest are there, the oldest are gone
    newest, oldest = answers[-1], answers[0]
    assert decoder.propose("n", newest[:12], "s0", 8, 8).tokens[:3] == newest[12:15]
    assert decoder.propose("o", oldest[:12], "s0", 8, 8).num_nodes == 0
    # an answer larger than the whole cap is not cached, and breaks nothing
    decoder.add_finished(list(range(400)), "s0")
    assert decoder.cache_bytes <= cap
    assert SuffixDecoder(max_cache_bytes=0).cache_bytes == 0
    with pytest.raises(ValueError, match="max_cache_bytes"):
        SuffixDecoder(max_cache_bytes=-1)


def _recount(decoder: SuffixDecoder) -> int:
    """The cache's footprint counted from scratch."""
    return sum(scope.footprint() for scope in decoder._scopes.values())


def _cached(decoder: SuffixDecoder, scope: str, answer: list[int]) -> bool:
    return decoder.propose("probe", answer[:8], scope, 4, 4).tokens[:2] == answer[8:10]


def test_eviction_takes_the_oldest_answers_of_any_scope_first():
    """Answers of three scopes, interleaved: once the cap bites, exactly a prefix of
    the insertion order is gone, the rest all answer; an evicted answer's index
    entries are gone with it (no stale key, no key left without a live occurrence)."""
    rng = random.Random(9)
    answers = [[rng.randrange(50_000) for _ in range(rng.randint(20, 60))] for _ in range(60)]
    decoder = SuffixDecoder(max_cache_bytes=40 * 40 * (BYTES_PER_TOKEN + 2 * BYTES_PER_KEY))
    for i, answer in enumerate(answers):
        decoder.add_finished(answer, f"s{i % 3}")
    alive = [_cached(decoder, f"s{i % 3}", answer) for i, answer in enumerate(answers)]
    first = alive.index(True)
    assert first > 0 and all(alive[first:])
    assert decoder.cache_tokens == sum(len(a) for a in answers[first:])
    for scope in decoder._scopes.values():
        text = scope.text
        live = text.tokens[scope.starts[0] - text.base :]
        assert set(text.last[0]) == set(live)
        assert all(end > text.floor for last in text.last for end in last.values())


def test_the_cache_memory_estimate_is_honest():
    """tracemalloc's count of a cache filled past its cap (so it evicts and drops dead
    prefixes) stays within the cap, and the estimate is not far above it either."""
    rng = random.Random(10)
    text = [rng.randrange(32_000) for _ in range(30_000)]
    pieces = [text[s : s + 150] for s in (rng.randrange(len(text) - 150) for _ in range(1_200))]
    cap = 1 << 20
    tracemalloc.start()
    try:
        decoder = SuffixDecoder(max_cache_bytes=cap)
        for i, piece in enumerate(pieces):
            decoder.add_finished(piece, f"s{i % 4}", num_prompt=20)
        used = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert decoder.cache_bytes <= cap
    assert 0.7 * decoder.cache_bytes <= used <= cap, (used, decoder.cache_bytes)


def test_a_templated_answer_is_continued_from_the_cache_deeply():
    """The same extraction template over many inputs: after a few answers, a new
    request's output follows the template from the cache, across the fields that
    differ."""
    rng = random.Random(7)
    template = [rng.randrange(5000) for _ in range(60)]
    decoder = SuffixDecoder()
    for _ in range(20):
        fields = [rng.randrange(5000) for _ in range(4)]
        decoder.add_finished([1, 2] + template[:10] + fields + template[10:], None, 2)
    context = [1, 2] + template[:10] + [rng.randrange(5000) for _ in range(4)] + template[10:30]
    tree = decoder.propose("new", context, None, 40, 40)
    _check(tree)
    assert tree.tokens[: tree.depth()] == template[30 : 30 + tree.depth()]
    assert tree.depth() >= 20


def test_price_tree_keeps_the_nodes_that_pay():
    tree = DraftTree([1, 2, 3, 4, 5], [-1, 0, 1, -1, 3], [0.9, 0.6, 0.2, 0.08, 0.01])
    assert price_tree(tree, 1.0, 0.0, 10).num_nodes == 5  # free: everything
    # a node pays when its score beats the cost times the value so far (~2.3 here)
    kept = price_tree(tree, 1.0, 0.05, 10)
    assert kept.tokens == [1, 2, 3] and kept.parents == [-1, 0, 1]
    assert price_tree(tree, 1.0, 5.0, 10) is None  # nothing pays
    assert price_tree(tree, 1.0, 0.0, 2).tokens == [1, 2]
    # an overconfident proposer (half of what it predicts is kept) gets smaller trees
    assert price_tree(tree, 0.3, 0.05, 10).num_nodes == 2


def _state(request_id: str, tokens: list[int], scope=None, finished=False, prompt=2):
    request = SimpleNamespace(
        request_id=request_id, all_token_ids=tokens, cache_scope=scope, num_tokens=len(tokens),
        num_accepted_tokens=0, num_prompt_tokens=prompt,
        is_finished=finished, num_output_tokens=len(tokens) - prompt,
    )  # fmt: skip
    return SimpleNamespace(request=request)


def test_the_proposer_caches_finished_answers_and_calibrates():
    rng = random.Random(8)
    answer = [rng.randrange(1000) for _ in range(40)]
    proposer = SuffixSpecProposer(max_nodes=16, cache_mib=1)
    item = SimpleNamespace(num_spec_tokens=16, spec_source="suffix", spec_token_cost=0.02)
    first = _state("a", [5, 6, *answer], scope="k1", finished=True)
    trees, probs = proposer.propose([item], [first])
    assert probs is None
    proposer.free("a")  # finished: its text joins k1's cache
    second = _state("b", [5, 6, *answer[:12]], scope="k1")
    trees, _ = proposer.propose([item], [second])
    assert trees[0].tokens[:4] == answer[12:16]
    before = proposer.calibration
    second.request.num_accepted_tokens = 0  # nothing kept: the scores were too confident
    proposer.on_verified([second.request])
    assert proposer.calibration < before
    other = _state("c", [5, 6, *answer[:12]], scope="k2")
    assert proposer.propose([item], [other])[0][0] == []  # k1's answer is not k2's
    # lanes by match length: a long match is "suffix", a one-token one "suffix-short"
    assert proposer.source_for(second.request) == ("suffix", proposer.draft_cost)
    short = _state("d", [5, 6, 7, 8, 9, 5], scope="k3")
    assert proposer.source_for(short.request)[0] == "suffix-short"
