"""VllmEngine.SubscribeKvEvents: what a subscriber rebuilds from the stream is the
target pool's prefix cache, with the right tokens and parent chain, through evictions,
resets, resumption and lagging."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from block_manager.hashing import BlockHasher, root_hash
from block_manager.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from engine.observability.stats import EngineStats
from engine.server.lifecycle import Lifecycle
from engine.server.rpc_guard import RpcGuard
from engine.server.vllm_kv_events import KvEventHub, block_hash_id
from engine.server.vllm_servicer import VllmEngineServicer
from tests.server.helpers import InProcessServer, wait_until

BS = 16


class Mirror:
    """A subscriber's view: block hash -> (parent hash or None, token ids)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.cursor = 0
        self.removed: list[int] = []
        self.num_cleared = 0

    def apply(self, batch: cpb.KvEventBatch) -> None:
        if batch.load.load_only:
            assert not batch.events and batch.sequence_number == self.cursor
            return
        if not batch.HasField("snapshot"):  # live batches: no gap, no duplicate
            assert batch.sequence_number == self.cursor + 1, (batch.sequence_number, self.cursor)
        for event in batch.events:
            kind = event.WhichOneof("data")
            if kind == "stored":
                parent = (
                    event.stored.parent_block_hash
                    if event.stored.HasField("parent_block_hash")
                    else None
                )
                for block in event.stored.blocks:
                    assert block.block_size == BS and len(block.token_ids) == BS
                    self.blocks[block.block_hash] = (parent, tuple(block.token_ids))
                    parent = block.block_hash
            elif kind == "removed":
                for block_hash in event.removed.block_hashes:
                    assert block_hash in self.blocks, "removed but never stored"
                    del self.blocks[block_hash]
                    self.removed.append(block_hash)
            else:
                self.blocks.clear()
                self.num_cleared += 1
        self.cursor = batch.sequence_number


class Subscription:
    """One SubscribeKvEvents call read on a thread into a Mirror."""

    def __init__(self, target: str, start: int = 0, mirror: Mirror | None = None) -> None:
        self.mirror = mirror or Mirror()
        self.batches: list[cpb.KvEventBatch] = []
        self.error: grpc.RpcError | None = None
        self._lock = threading.Lock()
        self._channel = grpc.insecure_channel(target)
        stub = vpb_grpc.VllmEngineStub(self._channel)
        self._call = stub.SubscribeKvEvents(
            cpb.SubscribeKvEventsRequest(start_sequence_number=start), timeout=120
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for batch in self._call:
                with self._lock:
                    self.batches.append(batch)
                    self.mirror.apply(batch)
        except grpc.RpcError as exc:
            self.error = exc

    def wait_for(self, sequence_number: int) -> None:
        wait_until(lambda: self.mirror.cursor >= sequence_number or self.error, 30, "batches")
        assert self.error is None or self.error.code() == grpc.StatusCode.CANCELLED, self.error

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(10)
        self._channel.close()


@pytest.fixture(scope="module")
def kv_server(engine_config):
    """31 usable KV blocks: a few long prompts evict each other's cached blocks."""
    with InProcessServer(dataclasses.replace(engine_config, num_kv_blocks=32)) as srv:
        yield srv


@pytest.fixture()
def stub(kv_server):
    with grpc.insecure_channel(kv_server.target) as channel:
        yield vpb_grpc.VllmEngineStub(channel)


def _generate(stub, prompt: list[int], max_tokens: int = 1) -> None:
    request = vpb.GenerateRequest(
        tokenized=vpb.TokenizedInput(input_ids=prompt),
        sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    list(stub.Generate(request, timeout=60))


def _pool(srv: InProcessServer):
    return srv.engine._engine.kv_manager.pool  # read while the engine is idle


def _caught_up(srv: InProcessServer, subscription: Subscription) -> None:
    """The subscriber's view equals the pool's prefix cache (the engine is idle). The
    events of a step reach the hub after the RPC that caused them may have returned, so
    this waits for the view rather than for a sequence number read too early."""
    cached = {block_hash_id(h) for h in _pool(srv).cached_blocks}

    def mirrored() -> bool:
        with subscription._lock:
            return set(subscription.mirror.blocks) == cached

    wait_until(lambda: mirrored() or subscription.error is not None, 30, "the mirror")
    subscription.wait_for(srv.server.kv_events.sequence_number)
    assert set(subscription.mirror.blocks) == cached


def _expected_ids(srv: InProcessServer, token_ids: list[int]) -> list[int]:
    manager = srv.engine._engine.kv_manager
    hashes: list[bytes] = []
    num_blocks = len(token_ids) // BS
    BlockHasher(BS).extend(hashes, root_hash(manager.cache_key, BS), token_ids, num_blocks)
    return [block_hash_id(h) for h in hashes]


def test_snapshot_first_then_a_store_per_committed_block(kv_server, stub):
    stub.FlushCache(cpb.FlushCacheRequest(), timeout=10)
    subscription = Subscription(kv_server.target)
    try:
        subscription.wait_for(kv_server.server.kv_events.sequence_number)
        first = subscription.batches[0]
        assert first.HasField("snapshot") and first.snapshot.index == 0
        assert first.events[0].WhichOneof("data") == "cleared"
        assert first.HasField("load") and first.load.max_running_requests > 0
        prompt = list(range(3, 43))  # 2 full blocks + 8 tokens
        _generate(stub, prompt)
        _caught_up(kv_server, subscription)
        first_id, second_id = _expected_ids(kv_server, prompt)
        blocks = subscription.mirror.blocks
        assert blocks[first_id] == (None, tuple(prompt[:16]))
        assert blocks[second_id] == (first_id, tuple(prompt[16:32]))  # the parent chain
        # A longer prompt sharing the prefix stores only its new blocks, chained on.
        longer = prompt[:32] + list(range(100, 120))
        before = len(subscription.batches)
        _generate(stub, longer)
        _caught_up(kv_server, subscription)
        stored = [
            e.stored
            for b in subscription.batches[before:]
            for e in b.events
            if e.WhichOneof("data") == "stored"
        ]
        (third_id,) = _expected_ids(kv_server, longer)[2:]
        assert [b.block_hash for s in stored for b in s.blocks] == [third_id]
        assert stored[0].parent_block_hash == second_id
    finally:
        subscription.close()


def test_evictions_are_removed_and_a_flush_clears(kv_server, stub):
    subscription = Subscription(kv_server.target)
    try:
        for i in range(6):  # 6 x 7 full blocks through a pool of 31: evictions
            _generate(stub, [(i * 37 + j) % 250 + 3 for j in range(7 * BS + 3)])
        _caught_up(kv_server, subscription)
        assert len(subscription.mirror.removed) >= 6
        stored_ever = {
            b.block_hash
            for batch in subscription.batches
            for e in batch.events
            if e.WhichOneof("data") == "stored"
            for b in e.stored.blocks
        }
        assert set(subscription.mirror.removed) <= stored_ever | set(subscription.mirror.blocks)
        cleared_before = subscription.mirror.num_cleared
        response = stub.FlushCache(cpb.FlushCacheRequest(), timeout=10)
        assert response.success, response.message
        _caught_up(kv_server, subscription)
        assert subscription.mirror.num_cleared == cleared_before + 1
        assert subscription.mirror.blocks == {} and not _pool(kv_server).cached_blocks
    finally:
        subscription.close()


def test_resume_from_a_sequence_number(kv_server, stub):
    first = Subscription(kv_server.target)
    _generate(stub, list(range(50, 90)))
    _caught_up(kv_server, first)
    first.close()
    resumed_at = first.mirror.cursor
    _generate(stub, list(range(90, 130)))  # batches the first subscriber never saw
    _generate(stub, list(range(130, 170)))
    mirror = Mirror()
    mirror.blocks, mirror.cursor = dict(first.mirror.blocks), resumed_at
    second = Subscription(kv_server.target, start=resumed_at + 1, mirror=mirror)
    try:
        _caught_up(kv_server, second)  # every batch after the cursor, in order, no gap
        assert not second.batches[0].HasField("snapshot")
        assert second.batches[0].sequence_number == resumed_at + 1
    finally:
        second.close()


def test_unservable_cursors_are_out_of_range(kv_server, stub):
    hub = kv_server.server.kv_events
    ahead = hub.sequence_number + 5
    call = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=ahead))
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert info.value.details().startswith(f"start_sequence_number {ahead} is ahead of")
    old_max, hub._max_batches = hub._max_batches, 2
    try:
        for i in range(4):
            _generate(stub, [200 + i] * (BS + 2))
        call = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=1))
        with pytest.raises(grpc.RpcError) as info:
            next(call)
        assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert "older than this server's history" in info.value.details()
    finally:
        hub._max_batches = old_max


def test_idle_stream_sends_load_heartbeats(kv_server):
    subscription = Subscription(kv_server.target)
    try:
        wait_until(lambda: any(b.load.load_only for b in subscription.batches), 30, "a heartbeat")
        heartbeat = next(b for b in subscription.batches if b.load.load_only)
        assert heartbeat.sequence_number == subscription.mirror.cursor
        assert heartbeat.load.max_running_requests > 0 and heartbeat.load.sample > 1
        assert heartbeat.load.HasField("max_total_num_tokens")  # heartbeats carry telemetry
    finally:
        subscription.close()


# ---- the hub and a lagging subscriber, without a server ------------------------------


def _stored(digest: int, parent: int | None, token: int) -> BlockStored:
    as_bytes = lambda n: n.to_bytes(16, "big")  # noqa: E731
    return BlockStored(
        as_bytes(digest), None if parent is None else as_bytes(parent), (token,) * BS
    )


def _replay(batches) -> Mirror:
    mirror = Mirror()
    for batch in batches:
        mirror.apply(batch)
    return mirror


def test_snapshot_lists_parents_first_in_chunks_numbered_up_to_now():
    hub = KvEventHub()
    hub.publish([AllBlocksCleared()])
    # 3000 blocks in chains of 3 in one batch; then block 1 goes and is stored again,
    # after its own children.
    events = [_stored(n, n - 1 if (n - 1) % 3 else None, n % 200) for n in range(1, 3001)]
    events += [BlockRemoved(_stored(1, None, 0).block_hash), _stored(1, None, 1)]
    hub.publish(events)
    chunks = hub.snapshot()
    assert [c.sequence_number for c in chunks] == [1, 2]  # as many chunks as sequences
    assert all(c.snapshot.count == 2 and c.snapshot.blocks == 3000 for c in chunks)
    assert chunks[0].events[0].WhichOneof("data") == "cleared"
    seen: set[int] = set()
    for chunk in chunks:
        for event in chunk.events:
            if event.WhichOneof("data") == "stored":
                stored = event.stored
                assert not stored.HasField("parent_block_hash") or stored.parent_block_hash in seen
                seen.update(b.block_hash for b in stored.blocks)
    assert len(seen) == 3000
    assert set(_replay(chunks).blocks) == seen
    late = hub.snapshot(after=1)  # a cursor at 1: one chunk, numbered 2
    assert [c.sequence_number for c in late] == [2]


class _FakeEngine:
    dead_error = None
    is_ready = True
    is_healthy = True
    num_in_flight = 0
    max_in_flight = 8
    stats = EngineStats()
    model_info: dict[str, Any] = {"max_num_seqs": 4, "num_kv_blocks": 64, "block_size": BS}


class _BlockingContext:
    """Writes wait while ``open`` is clear: a client that stopped reading."""

    def __init__(self) -> None:
        self.written: list[cpb.KvEventBatch] = []
        self.open = asyncio.Event()
        self.open.set()

    async def write(self, message) -> None:
        await self.open.wait()
        self.written.append(message)

    def done(self) -> bool:
        return False

    def time_remaining(self):
        return None


def test_a_lagging_subscriber_costs_bounded_memory_and_gets_the_state():
    async def scenario() -> None:
        hub = KvEventHub(max_history_batches=4)
        hub.attach(asyncio.get_running_loop())
        lifecycle = Lifecycle()
        servicer = VllmEngineServicer(_FakeEngine(), RpcGuard(lifecycle), hub)
        context = _BlockingContext()
        task = asyncio.create_task(servicer._subscribe(cpb.SubscribeKvEventsRequest(), context))
        await asyncio.sleep(0.05)
        assert [b.HasField("snapshot") for b in context.written] == [True]
        context.open.clear()  # the client stops reading
        for n in range(1, 201):  # the engine keeps publishing, never waiting
            evicted = [BlockRemoved(_stored(n - 5, None, 0).block_hash)] if n > 5 else []
            hub.publish([_stored(n, None, n % 200), *evicted])
            assert len(hub._history) <= 4
            await asyncio.sleep(0)
        context.open.set()  # it reads again: what it missed is gone, it gets the state
        await asyncio.sleep(0.3)
        lifecycle.draining = True
        await asyncio.wait_for(task, 5)
        mirror = _replay(context.written)
        assert mirror.cursor == hub.sequence_number
        assert set(mirror.blocks) == {block_hash_id(h) for h in hub._cached}
        assert any(b.HasField("snapshot") for b in context.written[1:])
        assert len(context.written) < 20  # the state, not 200 batches

    asyncio.run(scenario())
