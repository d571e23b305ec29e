"""What the prefix cache gained and lost, as events for an outside index (a router
that sends each request to the replica already holding its prefix).

A block enters the prefix cache when ``KVCacheManager`` commits it under a hash no other
block holds (``BlockStored``) and leaves when ``BlockPool`` evicts it for reuse or a reset
drops it (``BlockRemoved``; ``AllBlocksCleared`` when a reset empties the cache). So,
replayed in order, "stored minus removed, cleared starting over" is always exactly the
pool's ``cached_blocks``.

The recorder only appends to a list: the engine thread drains it after each step. It
records nothing until ``enabled`` (an engine nobody drains must not grow a list forever).
"""

from __future__ import annotations

from typing import NamedTuple


class BlockStored(NamedTuple):
    block_hash: bytes
    # The hash of the block before it in the request, None for a request's first block.
    parent_hash: bytes | None
    token_ids: tuple[int, ...]


class BlockRemoved(NamedTuple):
    block_hash: bytes


class AllBlocksCleared(NamedTuple):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventRecorder:
    """Collects prefix-cache events in order; ``take`` hands them over."""

    __slots__ = ("enabled", "_events")

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self._events: list[KVEvent] = []

    def stored(self, block_hash: bytes, parent_hash: bytes | None, token_ids) -> None:
        if self.enabled:
            self._events.append(BlockStored(block_hash, parent_hash, tuple(token_ids)))

    def removed(self, block_hash: bytes) -> None:
        if self.enabled:
            self._events.append(BlockRemoved(block_hash))

    def cleared(self) -> None:
        if self.enabled:
            self._events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """The events since the last call, oldest first."""
        events, self._events = self._events, []
        return events


def apply_events(cached: dict[bytes, BlockStored], events: list[KVEvent]) -> None:
    """Replay ``events`` onto ``cached`` (hash -> its store event): what a subscriber
    holds after reading them."""
    for event in events:
        if isinstance(event, BlockStored):
            cached[event.block_hash] = event
        elif isinstance(event, BlockRemoved):
            cached.pop(event.block_hash, None)
        else:
            cached.clear()
