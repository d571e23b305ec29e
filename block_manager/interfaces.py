"""What the block manager needs to know about a request (structural typing, no import
of the scheduler)."""

from __future__ import annotations

from typing import Protocol


class CacheRequest(Protocol):
    request_id: str
    # Verified tokens only: prompt + accepted outputs. Draft tokens are never here,
    # so they can never be hashed into the prefix cache.
    all_token_ids: list[int]
    # Tokens whose KV is already in the cache (the scheduler advances it after a step).
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...
