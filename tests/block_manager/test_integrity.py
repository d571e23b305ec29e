from __future__ import annotations

import pytest

from block_manager import KVCacheManager
from tests.block_manager.fakes import FakeRequest


def corrupted_manager() -> tuple[KVCacheManager, list[int]]:
    manager = KVCacheManager(8, block_size=4)
    manager.allocate_slots(FakeRequest("a", list(range(9))), 9)
    manager.check_integrity()
    return manager, manager.get_block_ids("a")


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda m, ids: setattr(m.pool.blocks[ids[0]], "ref_cnt", 2), "tables hold it"),
        (lambda m, ids: setattr(m.pool.blocks[ids[2]], "ref_cnt", -1), "free queue|negative"),
        (lambda m, ids: m.pool.free([m.pool.blocks[ids[2]]]), "ref_cnt"),
        (lambda m, ids: setattr(m.pool.blocks[ids[0]], "block_hash", b"x"), "content changed"),
        (lambda m, ids: m.pool.cached_blocks.clear(), "missing from the hash map"),
        (lambda m, ids: m._requests["a"].block_ids.append(ids[0]), "holds a block twice"),
        (lambda m, ids: m._requests["a"].block_ids.append(0), "null block"),
        (lambda m, ids: m.pool.free_block_queue.popleft(), "not in the free queue"),
    ],
)
def test_check_integrity_detects_corruption(corrupt, message: str) -> None:
    manager, block_ids = corrupted_manager()
    corrupt(manager, block_ids)
    with pytest.raises(RuntimeError, match=message):
        manager.check_integrity()
