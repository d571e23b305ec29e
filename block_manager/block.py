"""KV cache blocks and the LRU free queue that links them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block of `block_size` KV slots.

    Invariants (checked by `check_integrity`):
      ref_cnt == number of block tables holding this block;
      ref_cnt == 0  <=>  the block is in the free queue (the null block excepted);
      block_hash is not None  =>  the pool's hash map sends block_hash to this block.
    """

    block_id: int
    ref_cnt: int = 0
    # Chained hash of the block's full, verified content; None while uncommitted.
    block_hash: bytes | None = None
    # Free-queue links; meaningful only while ref_cnt == 0.
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        hashed = self.block_hash is not None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={hashed})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in LRU order.

    front (evicted first) <-> ... <-> back (freed most recently)

    Sentinel head/tail nodes keep every operation branch-free and O(1), including
    `remove` of a block from the middle (a prefix-cache hit on a free block).
    """

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the least recently freed block."""
        block = self._head.next_free_block
        if block is self._tail:
            raise IndexError("pop from an empty FreeKVCacheBlockQueue")
        self.remove(block)
        return block

    def popleft_n(self, num_blocks: int) -> list[KVCacheBlock]:
        """Remove and return the num_blocks least recently freed blocks (<= len)."""
        if num_blocks > self.num_free_blocks:
            raise IndexError(f"popleft_n({num_blocks}) from a queue of {self.num_free_blocks}")
        head = self._head
        block = head.next_free_block
        blocks = []
        for _ in range(num_blocks):
            blocks.append(block)
            next_block = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = next_block
        # Splice: the head now links straight to the first block left.
        head.next_free_block = block
        block.prev_free_block = head
        self.num_free_blocks -= num_blocks
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` (which must be in the queue) in O(1)."""
        prev_block = block.prev_free_block
        next_block = block.next_free_block
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the back: it will be evicted last."""
        last = self._tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def __iter__(self):
        """Blocks from front (next to evict) to back."""
        block = self._head.next_free_block
        while block is not self._tail:
            yield block
            block = block.next_free_block
