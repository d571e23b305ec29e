from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from block_manager import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def test_import_does_not_load_torch() -> None:
    code = "import sys, block_manager; sys.exit('torch' in sys.modules)"
    repo_root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=repo_root).returncode == 0


def test_free_queue_lru_order_and_o1_remove() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert [b.block_id for b in queue] == [1, 3]
    queue.append(blocks[4])
    queue.append(blocks[0])
    assert len(queue) == 4
    assert [queue.popleft().block_id for _ in range(4)] == [1, 3, 4, 0]
    with pytest.raises(IndexError):
        queue.popleft()


def test_pool_reserves_null_block_and_evicts_on_allocate() -> None:
    pool = BlockPool(4)
    assert pool.num_usable_blocks == 3 and pool.num_free_blocks == 3
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert pool.cache_block(blocks[0], b"h0")
    assert not pool.cache_block(blocks[1], b"h0")  # same content elsewhere: stays un-hashed
    assert blocks[1].block_hash is None
    assert pool.free(blocks) == 3
    pool.touch([blocks[0]])  # a hit on a free cached block takes it out of the queue
    assert [b.block_id for b in pool.free_block_queue] == [2, 3]
    pool.free([blocks[0]])
    assert [b.block_id for b in pool.allocate(3)][-1] == 1
    assert blocks[0].block_hash is None and b"h0" not in pool.cached_blocks


def test_pool_rejects_too_few_blocks() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)
