"""Paged KV block bookkeeping: block pool, prefix cache, per-request block tables.

Pure Python (no torch): the scheduler drives it in token counts and block ids.
"""

from __future__ import annotations

from block_manager.block import FreeKVCacheBlockQueue, KVCacheBlock
from block_manager.block_pool import NULL_BLOCK_ID, BlockPool
from block_manager.interfaces import CacheRequest
from block_manager.kv_cache_manager import KVCacheManager
from block_manager.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventRecorder,
)

__all__ = [
    "NULL_BLOCK_ID",
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheRequest",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "KVEventRecorder",
]
