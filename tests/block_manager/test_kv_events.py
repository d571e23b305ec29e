"""Prefix-cache events: what a subscriber rebuilds from them is always the pool's
cached_blocks, with the right tokens and parent chain."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from block_manager import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheManager,
    KVEventRecorder,
)
from block_manager.hashing import BlockHasher, root_hash
from block_manager.kv_events import apply_events
from tests.block_manager.fakes import FakeRequest
from tests.block_manager.test_property import BS, PREFIXES, Simulation, op


def _manager(
    num_blocks: int, block_size: int = BS, **kwargs
) -> tuple[KVCacheManager, KVEventRecorder]:
    recorder = KVEventRecorder(enabled=True)
    manager = KVCacheManager(num_blocks, block_size, event_sink=recorder, **kwargs)
    return manager, recorder


def _prefill(manager: KVCacheManager, request: FakeRequest) -> None:
    hit_ids, num_cached = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_cached, 0, hit_ids) is not None
    request.num_computed_tokens = request.num_tokens


def _expected_hash(parent: bytes | None, token_ids: tuple[int, ...], cache_key: str = "") -> bytes:
    hashes: list[bytes] = []
    BlockHasher(len(token_ids)).extend(
        hashes, parent or root_hash(cache_key, len(token_ids)), token_ids, 1
    )
    return hashes[0]


def test_commit_stores_each_full_block_with_its_tokens_and_parent() -> None:
    manager, recorder = _manager(8)
    request = FakeRequest("a", list(range(1, 11)))  # 2 full blocks of 4 + 2 tokens
    _prefill(manager, request)
    events = recorder.take()
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    first, second = events
    assert first.token_ids == (1, 2, 3, 4) and first.parent_hash is None
    assert second.token_ids == (5, 6, 7, 8) and second.parent_hash == first.block_hash
    assert first.block_hash == _expected_hash(None, first.token_ids)
    assert second.block_hash == _expected_hash(first.block_hash, second.token_ids)
    assert set(manager.pool.cached_blocks) == {first.block_hash, second.block_hash}
    assert recorder.take() == []  # taken once


def test_same_prefix_again_stores_nothing_new() -> None:
    manager, recorder = _manager(8)
    _prefill(manager, FakeRequest("a", list(range(1, 11))))
    recorder.take()
    _prefill(manager, FakeRequest("b", list(range(1, 11))))  # a prefix hit
    assert recorder.take() == []


def test_eviction_removes_and_reset_clears() -> None:
    manager, recorder = _manager(4)  # 3 usable blocks
    a = FakeRequest("a", list(range(1, 10)))  # 2 full blocks, 3 blocks held
    _prefill(manager, a)
    stored = [e.block_hash for e in recorder.take()]
    manager.free(a)
    b = FakeRequest("b", [50] * 9)  # needs all 3 blocks: both cached ones are evicted
    _prefill(manager, b)
    events = recorder.take()
    removed = [e.block_hash for e in events if isinstance(e, BlockRemoved)]
    assert sorted(removed) == sorted(stored)
    assert [type(e) for e in events].count(BlockStored) == 2  # b's own blocks
    manager.free(b)
    assert manager.reset_prefix_cache() == 2
    assert recorder.take() == [AllBlocksCleared()]
    assert manager.pool.cached_blocks == {}


def test_reset_while_blocks_are_in_use_removes_only_what_it_drops() -> None:
    manager, recorder = _manager(8)
    a, b = FakeRequest("a", list(range(1, 6))), FakeRequest("b", [9] * 5)
    _prefill(manager, a)
    _prefill(manager, b)
    a_hash, b_hash = (e.block_hash for e in recorder.take())
    manager.free(a)
    assert manager.reset_prefix_cache() == 1
    assert recorder.take() == [BlockRemoved(a_hash)]  # b still reads its block
    assert set(manager.pool.cached_blocks) == {b_hash}


def test_disabled_recorder_and_no_sink_record_nothing() -> None:
    recorder = KVEventRecorder()
    manager = KVCacheManager(8, BS, event_sink=recorder)
    _prefill(manager, FakeRequest("a", list(range(1, 11))))
    assert recorder.take() == []
    plain = KVCacheManager(8, BS)
    _prefill(plain, FakeRequest("a", list(range(1, 11))))
    assert len(plain.pool.cached_blocks) == 2


class Subscriber:
    """Rebuilds the cache from events, checking each one as it arrives."""

    def __init__(self, manager: KVCacheManager, sim: Simulation) -> None:
        self.manager = manager
        self.sim = sim
        self.cached: dict[bytes, BlockStored] = {}

    def read(self, events) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                assert event.block_hash not in self.cached, "stored twice"
                assert len(event.token_ids) == BS
                parent = event.parent_hash
                assert event.block_hash == _expected_hash(parent, event.token_ids)
            elif isinstance(event, BlockRemoved):
                assert event.block_hash in self.cached, "removed but never stored"
            apply_events(self.cached, [event])

    def check(self) -> None:
        pool = self.manager.pool
        assert set(self.cached) == set(pool.cached_blocks)
        for block_hash, event in self.cached.items():
            # The block's slots hold exactly the tokens the event announced.
            block_id = pool.cached_blocks[block_hash].block_id
            assert tuple(self.sim.kv[block_id]) == event.token_ids


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(st.tuples(op, st.integers(0, 99)), min_size=20, max_size=80),
    num_blocks=st.integers(4, 24),
)
def test_stored_minus_removed_is_always_the_cache(ops, num_blocks: int) -> None:
    manager, recorder = _manager(num_blocks)
    sim = Simulation(manager)
    subscriber = Subscriber(manager, sim)
    for i, ((kind, *args), pick) in enumerate(ops):
        running = list(sim.running.values())
        target = running[pick % len(running)] if running else None
        if kind == "arrive":
            tokens = PREFIXES[args[0]] + args[1] + [i + 100]
            sim.admit(FakeRequest(f"r{i}", tokens), num_lookahead=pick % 3)
        elif kind == "retry" and sim.waiting:
            sim.admit(sim.waiting.pop(0), num_lookahead=args[0])
        elif kind == "step" and target is not None:
            sim.spec_step(target, [d + 10 for d in args[0]], min(args[1], len(args[0])))
        elif kind == "rollback" and target is not None:
            target.num_computed_tokens = manager.rollback(
                target, int(args[0] * target.num_computed_tokens)
            )
        elif kind in ("preempt", "finish") and target is not None:
            manager.free(target)
            del sim.running[target.request_id]
            if kind == "preempt":
                target.num_computed_tokens = 0
                sim.waiting.append(target)
        elif kind == "reset":
            manager.reset_prefix_cache()
        subscriber.read(recorder.take())
        subscriber.check()
