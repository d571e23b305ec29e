"""Test doubles and invariant helpers for the block manager tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from block_manager import KVCacheManager


@dataclass
class FakeRequest:
    """Satisfies block_manager.CacheRequest: verified tokens only in all_token_ids."""

    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class CheckedManager:
    """Proxy that runs check_integrity() after every method call on the manager."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.manager, name)
        if not callable(attr):
            return attr

        def checked(*args: Any, **kwargs: Any) -> Any:
            result = attr(*args, **kwargs)
            self.manager.check_integrity()
            return result

        return checked


def make_manager(num_blocks: int = 16, **kwargs: Any) -> CheckedManager:
    manager = KVCacheManager(num_blocks, **kwargs)
    manager.check_integrity()
    return CheckedManager(manager)


def prefill(manager: CheckedManager, request: FakeRequest, num_lookahead: int = 0) -> list[int]:
    """Prefix lookup + allocate the rest of the prompt, like the scheduler's first step."""
    hit_ids, num_cached = manager.get_computed_blocks(request)
    num_new = request.num_tokens - num_cached
    new_ids = manager.allocate_slots(request, num_new, num_lookahead, hit_ids)
    assert new_ids is not None
    request.num_computed_tokens = request.num_tokens
    return hit_ids


def snapshot(manager: CheckedManager) -> tuple:
    """Everything observable about the pool and the tables."""
    inner = manager.manager
    pool = inner.pool
    return (
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue],
        dict(pool.cached_blocks),
        {rid: list(s.block_ids) for rid, s in inner._requests.items() if s.block_ids},
    )
