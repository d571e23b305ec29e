from __future__ import annotations

import pytest

from tests.block_manager.fakes import FakeRequest, make_manager, prefill, snapshot

BS = 16


def tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


@pytest.mark.parametrize(
    ("num_tokens", "num_blocks", "num_hashed"), [(16, 1, 1), (17, 2, 1), (32, 2, 2)]
)
def test_prefill_block_counts_and_hashing(num_tokens: int, num_blocks: int, num_hashed: int):
    manager = make_manager()
    request = FakeRequest("a", tokens(num_tokens))
    new_ids = manager.allocate_slots(request, num_tokens)
    assert new_ids == manager.get_block_ids("a") and len(new_ids) == num_blocks
    assert len(manager.pool.cached_blocks) == num_hashed
    assert manager.usage == num_blocks / manager.num_blocks


@pytest.mark.parametrize(
    ("num_tokens", "num_hit_blocks"), [(16, 0), (17, 1), (32, 1), (33, 2), (40, 2)]
)
def test_prefix_hit_never_covers_last_token(num_tokens: int, num_hit_blocks: int) -> None:
    manager = make_manager()
    prefill(manager, FakeRequest("a", tokens(48)))
    hit_ids, num_cached = manager.get_computed_blocks(FakeRequest("b", tokens(num_tokens)))
    assert num_cached == num_hit_blocks * BS and len(hit_ids) == num_hit_blocks
    assert hit_ids == manager.get_block_ids("a")[:num_hit_blocks]


def test_lookup_is_pure_and_counts_tokens() -> None:
    manager = make_manager()
    prefill(manager, FakeRequest("a", tokens(40)))
    before = snapshot(manager)
    manager.get_computed_blocks(FakeRequest("b", tokens(33)))
    assert snapshot(manager) == before
    assert manager.num_prefix_query_tokens == 40 + 33
    assert manager.num_prefix_hit_tokens == 32


def test_prefix_hit_shares_blocks_and_touches_free_cached_ones() -> None:
    manager = make_manager()
    a = FakeRequest("a", tokens(40))
    prefill(manager, a)
    a_ids = manager.get_block_ids("a")
    manager.free(a)
    b = FakeRequest("b", tokens(36))
    hit_ids = prefill(manager, b)
    assert hit_ids == a_ids[:2]
    assert manager.get_block_ids("b")[:2] == a_ids[:2]
    assert all(manager.pool.blocks[i].ref_cnt == 1 for i in hit_ids)
    assert manager.num_free_blocks == manager.num_blocks - 3


def test_lookahead_slots_cross_block_boundary() -> None:
    manager = make_manager()
    request = FakeRequest("a", tokens(15), num_computed_tokens=0)
    assert len(manager.allocate_slots(request, 14)) == 1
    request.num_computed_tokens = 14
    # 14 computed + 1 new + 4 lookahead = 19 slots -> a second block.
    new_ids = manager.allocate_slots(request, 1, num_lookahead_tokens=4)
    assert len(new_ids) == 1 and len(manager.get_block_ids("a")) == 2
    assert manager.allocate_slots(request, 1, num_lookahead_tokens=4) == []


def test_draft_tokens_never_enter_prefix_cache() -> None:
    manager = make_manager()
    request = FakeRequest("a", tokens(13))
    manager.allocate_slots(request, 13, num_lookahead_tokens=3)  # drafts fill block 0
    assert manager.pool.cached_blocks == {}
    request.num_computed_tokens = 13
    drafts = [7, 8, 9]
    # Verification rejects every draft: the prompt extended by the drafts never hits.
    assert manager.rollback(request, 13) == 13
    other = FakeRequest("b", tokens(13) + drafts + [5])
    assert manager.get_computed_blocks(other) == ([], 0)
    # Once accepted (in all_token_ids) and computed, the block is committed.
    request.all_token_ids += drafts
    manager.allocate_slots(request, 3)
    assert manager.get_computed_blocks(other)[1] == 16


def test_duplicate_content_keeps_one_map_entry() -> None:
    manager = make_manager()
    a, b = FakeRequest("a", tokens(33)), FakeRequest("b", tokens(33))
    manager.allocate_slots(a, 33)
    manager.allocate_slots(b, 33)  # computed again without a lookup: same content
    assert len(manager.pool.cached_blocks) == 2
    b_blocks = [manager.pool.blocks[i] for i in manager.get_block_ids("b")]
    assert all(block.block_hash is None for block in b_blocks)


def test_exhausted_pool_returns_none_and_changes_nothing() -> None:
    manager = make_manager(num_blocks=5)  # 4 usable
    a = FakeRequest("a", tokens(33))
    prefill(manager, a)
    manager.free(a)
    b = FakeRequest("b", tokens(80))
    hit_ids, num_cached = manager.get_computed_blocks(b)
    assert num_cached == 32
    before = snapshot(manager)
    # 5 blocks needed: 2 hits (both in the free queue) + 3 new > 4 - 2 available.
    assert manager.allocate_slots(b, 80 - num_cached, 0, hit_ids) is None
    assert snapshot(manager) == before
    assert manager.get_block_ids("b") == []
    c = FakeRequest("c", tokens(17, start=5))
    assert manager.allocate_slots(c, 17, 100) is None
    assert snapshot(manager) == before
    # Two new blocks fit next to the two touched hits.
    b.all_token_ids = b.all_token_ids[:64]
    assert len(manager.allocate_slots(b, 32, 0, hit_ids)) == 2
    assert manager.num_free_blocks == 0 and manager.usage == 1.0


def test_two_cache_keys_never_share_blocks() -> None:
    target = make_manager(cache_key="target:fp16")
    draft = make_manager(cache_key="draft:fp16")
    same = make_manager(cache_key="target:fp16")
    for manager in (target, draft, same):
        manager.allocate_slots(FakeRequest("a", tokens(48)), 48)
    assert not set(target.pool.cached_blocks) & set(draft.pool.cached_blocks)
    assert set(target.pool.cached_blocks) == set(same.pool.cached_blocks)


def test_caching_disabled_never_hashes() -> None:
    manager = make_manager(enable_caching=False)
    manager.allocate_slots(FakeRequest("a", tokens(48)), 48)
    assert manager.pool.cached_blocks == {}
    assert manager.get_computed_blocks(FakeRequest("b", tokens(48))) == ([], 0)
    with pytest.raises(ValueError, match="disabled"):
        manager.allocate_slots(FakeRequest("b", tokens(48)), 16, 0, [1])


def test_bad_arguments_raise_value_error() -> None:
    manager = make_manager()
    request = FakeRequest("a", tokens(20))
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots(request, -1)
    with pytest.raises(ValueError, match="num_lookahead_tokens"):
        manager.allocate_slots(request, 1, -2)
    manager.allocate_slots(request, 20)
    with pytest.raises(ValueError, match=r"num_tokens must be in \[0, 32\]"):
        manager.rollback(request, 33)
    with pytest.raises(ValueError, match="num_tokens"):
        manager.rollback(request, -1)
    with pytest.raises(ValueError, match="holds no blocks"):
        manager.allocate_slots(request, 1, 0, [1])


def test_stale_prefix_hit_is_rejected() -> None:
    manager = make_manager(num_blocks=4)  # 3 usable
    a = FakeRequest("a", tokens(33))
    prefill(manager, a)
    manager.free(a)
    b = FakeRequest("b", tokens(33))
    hit_ids, _ = manager.get_computed_blocks(b)
    manager.allocate_slots(FakeRequest("c", tokens(48, start=1)), 48)  # evicts a's blocks
    with pytest.raises(ValueError, match="no longer holds"):
        manager.allocate_slots(b, 1, 0, hit_ids)


def test_reset_prefix_cache_drops_only_free_hashes() -> None:
    manager = make_manager()
    a, b = FakeRequest("a", tokens(33)), FakeRequest("b", tokens(33, start=1))
    prefill(manager, a)
    prefill(manager, b)
    manager.free(a)
    assert manager.reset_prefix_cache() == 2
    assert len(manager.pool.cached_blocks) == 2
    assert manager.get_computed_blocks(FakeRequest("c", tokens(33)))[1] == 0
