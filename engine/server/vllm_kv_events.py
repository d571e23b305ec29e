"""The target pool's prefix-cache events as the gateway's KvEventBatch stream.

The engine thread drains its KVEventRecorder after every step and hands the events to
``KvEventHub.publish_threadsafe``; on the event loop each non-empty hand-over becomes
one batch with the next sequence number (1, 2, ...: one publisher, the target pool;
batch 1 is an AllBlocksCleared sent when the engine starts, so a restarted server is
never mistaken for the one before it). The hub keeps

- a bounded history of recent batches (MAX_HISTORY_BATCHES, and MAX_HISTORY_TOKENS
  token ids in stored blocks), for subscribers that resume from a sequence number;
- the cache as the events describe it (hash -> parent and tokens), for a state
  snapshot: a new subscriber, or one whose cursor fell out of the history, gets
  ``KvSnapshotChunk`` batches (an AllBlocksCleared, then every cached block, parents
  first) numbered so the last one is the current sequence; live batches follow with no
  gap and no duplicate.

Subscribers share the history and hold only a cursor into it: a slow one costs no
memory and never slows the engine or the others; when it catches up and its cursor
has left the history, it is sent a snapshot instead of what it missed.

Block hashes are our 128-bit blake2b chain; the proto carries int64: the last 8 bytes,
big-endian, as a signed integer.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Iterator

from smg_grpc_proto.generated import common_pb2 as cpb

from block_manager.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    apply_events,
)

MAX_HISTORY_BATCHES = 4096
MAX_HISTORY_TOKENS = 1 << 20
SNAPSHOT_CHUNK_BLOCKS = 1024
_TIER = cpb.KV_CACHE_TIER_DEVICE
_LOCAL = cpb.KV_CACHE_LOCALITY_LOCAL


def block_hash_id(digest: bytes) -> int:
    """The proto's int64 identity of one of our block hashes."""
    return int.from_bytes(digest[-8:], "big", signed=True)


class CursorOutOfRange(Exception):
    """A resume cursor this server cannot serve; the message says why, on one line."""


class KvEventHub:
    """Sequence numbers, history, cache state and wake-ups for every subscriber."""

    def __init__(
        self,
        max_history_batches: int = MAX_HISTORY_BATCHES,
        max_history_tokens: int = MAX_HISTORY_TOKENS,
    ) -> None:
        self.sequence_number = 0
        self._max_batches = max_history_batches
        self._max_tokens = max_history_tokens
        self._history: deque[tuple[cpb.KvEventBatch, int]] = deque()  # (batch, its tokens)
        self._history_tokens = 0
        self._cached: dict[bytes, BlockStored] = {}  # insertion order: store order
        self._event_ids = itertools.count(1)
        self._changed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Publish on ``loop`` from now on; starts the stream with AllBlocksCleared."""
        self._loop = loop
        self.publish([AllBlocksCleared()])

    # ---- publishing (engine thread -> event loop) ---------------------------------
    def publish_threadsafe(self, events: list[KVEvent]) -> None:
        """Called on the engine thread: never blocks it."""
        # A closed loop raises RuntimeError: nobody is listening any more.
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self.publish, events)

    def publish(self, events: list[KVEvent]) -> None:
        self.sequence_number += 1
        batch = cpb.KvEventBatch(sequence_number=self.sequence_number, timestamp=time.time())
        batch.events.extend(self._to_proto(events, self._event_ids))
        num_tokens = sum(len(e.token_ids) for e in events if isinstance(e, BlockStored))
        self._history.append((batch, num_tokens))
        self._history_tokens += num_tokens
        while len(self._history) > 1 and (
            len(self._history) > self._max_batches or self._history_tokens > self._max_tokens
        ):
            self._history_tokens -= self._history.popleft()[1]
        apply_events(self._cached, events)
        self._changed.set()

    # ---- reading (subscribers, on the event loop) ---------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def oldest_sequence_number(self) -> int:
        return self._history[0][0].sequence_number if self._history else 0

    async def wait(self, after: int, timeout_s: float) -> None:
        """Until a batch after sequence ``after`` exists, or ``timeout_s`` passed."""
        while self.sequence_number <= after:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                return

    def batches_after(self, cursor: int) -> list[cpb.KvEventBatch] | None:
        """The batches after ``cursor``; None when the history no longer holds them all."""
        if cursor >= self.sequence_number:
            return []
        if cursor + 1 < self.oldest_sequence_number:
            return None
        first = cursor + 1 - self.oldest_sequence_number
        return [batch for batch, _ in itertools.islice(self._history, first, None)]

    def resume(self, start: int) -> list[cpb.KvEventBatch]:
        """What a subscriber resuming at ``start`` is sent: the batches from ``start``
        on (``start`` itself too where still held: a subscriber that names the last
        batch it has skips it). CursorOutOfRange when this server cannot serve it."""
        if start > self.sequence_number:
            raise CursorOutOfRange(
                f"start_sequence_number {start} is ahead of this server's last sequence "
                f"{self.sequence_number} (the server restarted); resubscribe from 0 for a "
                "state snapshot"
            )
        batches = self.batches_after(start - 1)
        if batches is None:
            batches = self.batches_after(start)
        if batches is None:
            raise CursorOutOfRange(
                f"start_sequence_number {start} is older than this server's history "
                f"({self.oldest_sequence_number} to {self.sequence_number}); resubscribe "
                "from 0 for a state snapshot"
            )
        return batches

    def snapshot(self, after: int = 0) -> list[cpb.KvEventBatch]:
        """The cache now, as chunks numbered up to the current sequence number and all
        above ``after`` (the subscriber's cursor: none of them may look stale to it)."""
        stores = list(_parents_first(self._cached))
        end = self.sequence_number
        per_chunk = max(SNAPSHOT_CHUNK_BLOCKS, -(-len(stores) // max(end - after, 1)))
        groups = [stores[i : i + per_chunk] for i in range(0, len(stores), per_chunk)] or [[]]
        chunks = []
        for index, group in enumerate(groups):
            batch = cpb.KvEventBatch(
                sequence_number=end - len(groups) + 1 + index, timestamp=time.time()
            )
            batch.snapshot.CopyFrom(
                cpb.KvSnapshotChunk(index=index, count=len(groups), blocks=len(stores))
            )
            events: list[KVEvent] = [AllBlocksCleared()] if index == 0 else []
            batch.events.extend(self._to_proto(events + group, itertools.repeat(0)))
            chunks.append(batch)
        return chunks

    # ---- proto --------------------------------------------------------------------
    def _to_proto(self, events: list[KVEvent], event_ids: Iterator[int]) -> list[cpb.KvCacheEvent]:
        """Events in order; a run of stores that chain one onto the next becomes one
        KvBlocksStored, a run of removals one KvBlocksRemoved."""
        out: list[cpb.KvCacheEvent] = []
        last_kind: type | None = None
        last_hash: bytes | None = None
        for event in events:
            kind = type(event)
            if kind is BlockStored:
                if last_kind is BlockStored and event.parent_hash == last_hash:
                    out[-1].stored.blocks.append(self._block(event))
                else:
                    out.append(
                        cpb.KvCacheEvent(event_id=next(event_ids), stored=self._stored(event))
                    )
                last_hash = event.block_hash
            elif kind is BlockRemoved:
                if last_kind is not BlockRemoved:
                    removed = cpb.KvBlocksRemoved(tier=_TIER, locality=_LOCAL)
                    out.append(cpb.KvCacheEvent(event_id=next(event_ids), removed=removed))
                out[-1].removed.block_hashes.append(block_hash_id(event.block_hash))
            else:
                out.append(cpb.KvCacheEvent(event_id=next(event_ids), cleared=cpb.KvCacheCleared()))
            last_kind = kind
        return out

    def _stored(self, event: BlockStored) -> cpb.KvBlocksStored:
        stored = cpb.KvBlocksStored(blocks=[self._block(event)], tier=_TIER, locality=_LOCAL)
        if event.parent_hash is not None:
            stored.parent_block_hash = block_hash_id(event.parent_hash)
        return stored

    def _block(self, event: BlockStored) -> cpb.KvBlock:
        return cpb.KvBlock(
            block_hash=block_hash_id(event.block_hash),
            token_ids=event.token_ids,
            block_size=len(event.token_ids),  # only full blocks are stored
        )


def _parents_first(cached: dict[bytes, BlockStored]) -> Iterator[BlockStored]:
    """Every cached block once, each after its parent when the parent is cached too
    (a block may have been stored before its parent was stored again)."""
    emitted: set[bytes] = set()
    for block_hash in cached:
        chain = []
        while block_hash is not None and block_hash in cached and block_hash not in emitted:
            chain.append(cached[block_hash])
            emitted.add(block_hash)
            block_hash = cached[block_hash].parent_hash
        yield from reversed(chain)
