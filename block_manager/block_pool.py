"""BlockPool: every physical block, their ref counts, the LRU free queue and the
prefix-hash map."""

from __future__ import annotations

from collections.abc import Iterable

from block_manager.block import FreeKVCacheBlockQueue, KVCacheBlock
from block_manager.kv_events import KVEventRecorder

NULL_BLOCK_ID = 0


class BlockPool:
    """Owns blocks 0..num_blocks-1. Block 0 is the null (padding) block: never handed
    out, never freed, never counted. Blocks 1..num_blocks-1 are usable.

    A free block (ref_cnt 0) may still carry a hash: it is an evictable cached block,
    reused as-is on a prefix hit or evicted (hash dropped) when allocated.
    """

    def __init__(self, num_blocks: int, event_sink: KVEventRecorder | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # hash -> the one block that holds this content (in use or free-but-cached).
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}
        # Told of every hash that enters or leaves cached_blocks (see kv_events.py).
        self.event_sink = event_sink

    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` blocks from the LRU front, evicting any cached content.

        The caller has checked num_blocks <= num_free_blocks.
        """
        cached = self.cached_blocks
        sink = self.event_sink
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                del cached[block.block_hash]
                if sink is not None:
                    sink.removed(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block; a free cached block leaves the queue."""
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> int:
        """Drop one reference on each block, in the given order; blocks reaching 0 join
        the back of the free queue (cached content kept). Returns how many did."""
        append = self.free_block_queue.append
        num_freed = 0
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                append(block)
                num_freed += 1
        return num_freed

    def cache_block(
        self,
        block: KVCacheBlock,
        block_hash: bytes,
        parent_hash: bytes | None = None,
        token_ids: tuple[int, ...] = (),
    ) -> bool:
        """Commit `block` under `block_hash` unless that content is already cached
        elsewhere (then the block stays un-hashed). Returns whether it was hashed.
        ``parent_hash`` and ``token_ids`` describe the content for the event sink."""
        if block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        if self.event_sink is not None:
            self.event_sink.stored(block_hash, parent_hash, token_ids)
        return True

    def reset_prefix_cache(self) -> int:
        """Drop the hash of every free block; returns how many were dropped. Blocks
        in use keep theirs (a request is still reading them)."""
        dropped = []
        for block in self.free_block_queue:
            if block.block_hash is not None:
                del self.cached_blocks[block.block_hash]
                dropped.append(block.block_hash)
                block.block_hash = None
        sink = self.event_sink
        if sink is not None and dropped:
            if self.cached_blocks:
                for block_hash in dropped:
                    sink.removed(block_hash)
            else:
                sink.cleared()
        return len(dropped)
