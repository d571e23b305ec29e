"""Invariant checks over a BlockPool and the block tables that reference it.

Raises RuntimeError (never `assert`, which `python -O` strips)."""

from __future__ import annotations

from collections import Counter

from block_manager.block_pool import NULL_BLOCK_ID, BlockPool


def _fail(message: str) -> None:
    raise RuntimeError(f"block manager integrity: {message}")


def _check_free_queue(pool: BlockPool) -> set[int]:
    """Walk the free queue; return the ids in it."""
    free_ids: set[int] = set()
    prev = pool.free_block_queue._head
    for block in pool.free_block_queue:
        if block.prev_free_block is not prev:
            _fail(f"free queue link broken at block {block.block_id}")
        if block.block_id in free_ids:
            _fail(f"block {block.block_id} is twice in the free queue")
        if block.block_id == NULL_BLOCK_ID:
            _fail("the null block is in the free queue")
        if block.ref_cnt != 0:
            _fail(f"free block {block.block_id} has ref_cnt {block.ref_cnt}")
        free_ids.add(block.block_id)
        prev = block
    if len(free_ids) != len(pool.free_block_queue):
        _fail(f"free queue length {len(pool.free_block_queue)} != {len(free_ids)} linked blocks")
    return free_ids


def _check_tables(pool: BlockPool, tables: dict[str, list[int]]) -> Counter[int]:
    """Check each table; return how many tables hold each block id."""
    holders: Counter[int] = Counter()
    for request_id, block_ids in tables.items():
        if len(set(block_ids)) != len(block_ids):
            _fail(f"request {request_id!r} holds a block twice: {block_ids}")
        for block_id in block_ids:
            if block_id == NULL_BLOCK_ID:
                _fail(f"the null block was handed out to request {request_id!r}")
            if not 0 < block_id < len(pool.blocks):
                _fail(f"request {request_id!r} holds unknown block {block_id}")
        holders.update(block_ids)
    return holders


def _check_hashes(pool: BlockPool) -> None:
    for block_hash, block in pool.cached_blocks.items():
        if block.block_hash != block_hash:
            _fail(f"hash map entry points at block {block.block_id} whose content changed")
    for block in pool.blocks:
        if block.block_hash is not None and pool.cached_blocks.get(block.block_hash) is not block:
            _fail(f"block {block.block_id} carries a hash missing from the hash map")


def check_integrity(pool: BlockPool, tables: dict[str, list[int]]) -> None:
    """free + in use == total; ref counts == table holders; hashes consistent."""
    free_ids = _check_free_queue(pool)
    holders = _check_tables(pool, tables)
    _check_hashes(pool)
    null = pool.null_block
    if null.ref_cnt != 0 or null.block_hash is not None:
        _fail(f"null block was used: {null}")
    num_in_use = 0
    for block in pool.blocks[1:]:
        if block.ref_cnt < 0:
            _fail(f"block {block.block_id} has negative ref_cnt {block.ref_cnt}")
        if block.ref_cnt != holders[block.block_id]:
            _fail(
                f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                f"{holders[block.block_id]} tables hold it"
            )
        if block.ref_cnt > 0:
            num_in_use += 1
        elif block.block_id not in free_ids:
            _fail(f"block {block.block_id} has ref_cnt 0 but is not in the free queue")
    if num_in_use + len(free_ids) != pool.num_usable_blocks:
        _fail(f"free {len(free_ids)} + in use {num_in_use} != total {pool.num_usable_blocks}")
