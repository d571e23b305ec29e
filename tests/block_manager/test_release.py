from __future__ import annotations

from tests.block_manager.fakes import FakeRequest, make_manager, prefill
from tests.block_manager.test_allocate import tokens


def test_rollback_to_zero_frees_everything() -> None:
    manager = make_manager()
    request = FakeRequest("a", tokens(10))
    manager.allocate_slots(request, 10, num_lookahead_tokens=30)
    assert manager.rollback(request, 0) == 0
    assert manager.get_block_ids("a") == [] and manager.usage == 0
    assert manager.num_blocks_freed_by_rollback == 3


def test_rollback_across_block_boundary() -> None:
    manager = make_manager()
    request = FakeRequest("a", tokens(10))
    ids = manager.allocate_slots(request, 10, num_lookahead_tokens=10)  # 20 slots
    assert manager.rollback(request, 12) == 12
    assert manager.get_block_ids("a") == ids[:1]
    assert manager.num_free_blocks == manager.num_blocks - 1
    assert manager.rollback(request, 12) == 12  # idempotent at the same length


def test_rollback_into_shared_prefix_block_rounds_down() -> None:
    manager = make_manager()
    a = FakeRequest("a", tokens(40))
    prefill(manager, a)
    b = FakeRequest("b", tokens(32) + [1, 2, 3, 4, 5])
    prefill(manager, b, num_lookahead=4)
    shared = manager.get_block_ids("a")[:2]
    assert manager.get_block_ids("b")[:2] == shared
    assert manager.rollback(b, 20) == 16  # block 1 is shared: never written again
    assert manager.get_block_ids("b") == shared[:1]
    assert manager.pool.blocks[shared[1]].ref_cnt == 1
    assert len(manager.get_block_ids("a")) == 3


def test_rollback_into_own_hashed_block_rounds_down() -> None:
    manager = make_manager()
    a = FakeRequest("a", tokens(40))
    prefill(manager, a)
    assert manager.rollback(a, 36) == 36  # block 2 is partial, private, un-hashed
    assert manager.rollback(a, 20) == 16  # block 1 is hashed
    a.num_computed_tokens = 16
    assert len(manager.pool.cached_blocks) == 2  # freed block 1 stays cached
    # Recomputing block 1 finds its content cached elsewhere: no second entry.
    manager.allocate_slots(a, 24)
    assert len(manager.pool.cached_blocks) == 2


def test_free_shared_prefix_keeps_other_request_intact() -> None:
    manager = make_manager()
    a, b = FakeRequest("a", tokens(40)), FakeRequest("b", tokens(35))
    prefill(manager, a)
    prefill(manager, b)
    b_ids = manager.get_block_ids("b")
    manager.free(a)
    assert manager.get_block_ids("b") == b_ids
    assert [manager.pool.blocks[i].ref_cnt for i in b_ids] == [1, 1, 1]
    assert manager.num_free_blocks == manager.num_blocks - 3
    manager.free(b)
    manager.free(b)  # twice: no-op
    manager.free(FakeRequest("unknown"))
    assert manager.usage == 0 and manager.num_free_blocks == manager.num_blocks
    assert manager.get_computed_blocks(FakeRequest("c", tokens(40)))[1] == 32


def test_eviction_is_lru_and_tail_first_on_free() -> None:
    manager = make_manager(num_blocks=7)  # 6 usable
    a = FakeRequest("a", tokens(48))
    b = FakeRequest("b", tokens(48, start=1))
    prefill(manager, a)
    prefill(manager, b)
    a_ids, b_ids = manager.get_block_ids("a"), manager.get_block_ids("b")
    manager.free(a)
    manager.free(b)
    free_order = [blk.block_id for blk in manager.pool.free_block_queue]
    assert free_order == a_ids[::-1] + b_ids[::-1]
    # Two new blocks evict a's tail first; a's first block stays cached.
    new_ids = manager.allocate_slots(FakeRequest("c", tokens(32, start=7)), 32)
    assert new_ids == [a_ids[2], a_ids[1]]
    assert manager.get_computed_blocks(FakeRequest("d", tokens(48)))[1] == 16
    assert manager.get_computed_blocks(FakeRequest("e", tokens(48, start=1)))[1] == 32
