"""KVCacheManager: per-request block tables over one BlockPool, with prefix caching and
rollback of rejected lookahead slots."""

from __future__ import annotations

from dataclasses import dataclass, field

from block_manager.block_pool import BlockPool
from block_manager.hashing import BlockHasher, root_hash
from block_manager.integrity import check_integrity
from block_manager.interfaces import CacheRequest
from block_manager.kv_events import KVEventRecorder


@dataclass(slots=True)
class _RequestState:
    # The block table: logical block i holds token slots [i*block_size, (i+1)*block_size).
    block_ids: list[int] = field(default_factory=list)
    # Chained hashes of the request's first len(block_hashes) full verified blocks
    # (a pure function of all_token_ids; computed once, reused by lookup and commit).
    block_hashes: list[bytes] = field(default_factory=list)
    # Leading blocks of the table already offered to the prefix cache.
    num_committed_blocks: int = 0


def _raise_beyond_capacity(num_tokens: int, capacity: int) -> None:
    raise ValueError(
        f"num_tokens must be in [0, {capacity}] (the current capacity), got {num_tokens}"
    )


def _raise_negative(num_new_tokens: int, num_lookahead_tokens: int) -> None:
    if num_new_tokens < 0:
        raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
    raise ValueError(f"num_lookahead_tokens must be >= 0, got {num_lookahead_tokens}")


class KVCacheManager:
    """Paged KV allocator for one model cache (target and draft each own one).

    Token layout of one request (block_size 4 for the picture):

        |<- num_computed ->|<- new ->|<- lookahead ->|
        [t0 t1 t2 t3][t4 t5 t6 t7][t8 d1 d2 d3][d4 . . .]
         committed (hashed)        partial      draft slots, never hashed

    Only blocks whose tokens are all in `request.all_token_ids` (verified) are hashed.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_caching: bool = True,
        cache_key: str = "",
        event_sink: KVEventRecorder | None = None,
    ) -> None:
        """``event_sink`` hears every block that enters or leaves the prefix cache."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.cache_key = cache_key
        self.pool = BlockPool(num_blocks, event_sink)
        # Hot-path aliases (the pool never replaces these objects).
        self._blocks = self.pool.blocks
        self._free_queue = self.pool.free_block_queue
        self._hasher = BlockHasher(block_size)
        self._root_hash = root_hash(cache_key, block_size)
        self._requests: dict[str, _RequestState] = {}
        # Metrics (monotonic counters).
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_blocks_freed_by_rollback = 0

    # ---- capacity -------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Usable blocks (the null block excluded)."""
        return self.pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, evictable cached blocks included."""
        return self.pool.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by at least one request."""
        num_usable = self.pool.num_usable_blocks
        return (num_usable - self.pool.free_block_queue.num_free_blocks) / num_usable

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] if it holds no blocks)."""
        state = self._requests.get(request_id)
        return list(state.block_ids) if state is not None else []

    # ---- prefix cache ---------------------------------------------------------------

    def get_computed_blocks(self, request: CacheRequest) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks: (block_ids, num_cached_tokens).

        Never covers the last token (its logits are needed), so at most
        (num_tokens - 1) // block_size blocks. Changes no ref count; remembers the
        request's block hashes for allocate_slots, so call free() for a waiting request
        that is dropped (a no-op when it holds nothing else).
        """
        if not self.enable_caching:
            return [], 0
        num_tokens = request.num_tokens
        self.num_prefix_query_tokens += num_tokens
        token_ids = request.all_token_ids
        max_blocks = min(max(num_tokens - 1, 0), len(token_ids)) // self.block_size
        if max_blocks == 0:
            return [], 0
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestState()
        hashes = state.block_hashes
        self._hasher.extend(hashes, self._root_hash, token_ids, max_blocks)
        cached = self.pool.cached_blocks
        block_ids = []
        for i in range(max_blocks):
            block = cached.get(hashes[i])
            if block is None:
                break
            block_ids.append(block.block_id)
        num_cached_tokens = len(block_ids) * self.block_size
        self.num_prefix_hit_tokens += num_cached_tokens
        return block_ids, num_cached_tokens

    def reset_prefix_cache(self) -> int:
        """Drop the hashes of all free blocks; returns how many were dropped."""
        return self.pool.reset_prefix_cache()

    # ---- allocation -----------------------------------------------------------------

    def allocate_slots(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        new_computed_block_ids: list[int] | None = None,
    ) -> list[int] | None:
        """Grow the block table to cover num_computed_tokens + prefix-hit tokens +
        num_new_tokens + num_lookahead_tokens slots.

        Returns the newly allocated block ids (maybe []), or None if the pool cannot
        supply them; then nothing has changed. On success, commits every full block of
        verified tokens whose KV is written by this step to the prefix cache.
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            _raise_negative(num_new_tokens, num_lookahead_tokens)
        bs = self.block_size
        state = self._requests.get(request.request_id)
        num_computed = request.num_computed_tokens
        if new_computed_block_ids:
            return self._allocate_with_hits(
                request, state, num_new_tokens, num_lookahead_tokens, new_computed_block_ids
            )
        num_held = len(state.block_ids) if state is not None else 0
        # Hot path (decode): usually no new block and nothing to commit.
        num_new_blocks = -(-(num_computed + num_new_tokens + num_lookahead_tokens) // bs) - num_held
        new_block_ids: list[int] = []
        if num_new_blocks > 0:
            if num_new_blocks > self._free_queue.num_free_blocks:
                return None
            if state is None:
                state = self._requests[request.request_id] = _RequestState()
            new_block_ids = [block.block_id for block in self.pool.allocate(num_new_blocks)]
            state.block_ids += new_block_ids
        if self.enable_caching and state is not None:
            # Inlined _maybe_commit: a commit happens only once every block_size tokens.
            token_ids = request.all_token_ids
            num_written = num_computed + num_new_tokens
            if num_written > len(token_ids):
                num_written = len(token_ids)
            if num_written // bs > state.num_committed_blocks:
                self._commit(state, token_ids, num_written // bs)
        return new_block_ids

    def _allocate_with_hits(
        self,
        request: CacheRequest,
        state: _RequestState | None,
        num_new_tokens: int,
        num_lookahead_tokens: int,
        hit_block_ids: list[int],
    ) -> list[int] | None:
        """allocate_slots for a request starting from prefix-hit blocks."""
        num_computed = request.num_computed_tokens + len(hit_block_ids) * self.block_size
        num_required = -(-(num_computed + num_new_tokens + num_lookahead_tokens) // self.block_size)
        num_new_blocks = num_required - len(hit_block_ids)
        # Hit blocks are touched before capacity is checked, so the ones sitting in the
        # free queue are not available to this allocation.
        num_free_hits = self._check_hits(request, state, hit_block_ids)
        if num_new_blocks > self._free_queue.num_free_blocks - num_free_hits:
            return None
        if state is None:
            state = self._requests[request.request_id] = _RequestState()
        self.pool.touch([self._blocks[i] for i in hit_block_ids])
        state.block_ids += hit_block_ids
        new_block_ids: list[int] = []
        if num_new_blocks > 0:
            new_block_ids = [block.block_id for block in self.pool.allocate(num_new_blocks)]
            state.block_ids += new_block_ids
        self._maybe_commit(state, request.all_token_ids, num_computed + num_new_tokens)
        return new_block_ids

    def _maybe_commit(self, state: _RequestState, token_ids: list[int], num_written: int) -> None:
        """Commit the full blocks among the first num_written tokens that are verified
        (in token_ids): their KV is written by the step being scheduled."""
        if num_written > len(token_ids):
            num_written = len(token_ids)
        num_full = num_written // self.block_size
        if num_full > state.num_committed_blocks:
            self._commit(state, token_ids, num_full)

    def _check_hits(
        self, request: CacheRequest, state: _RequestState | None, hit_block_ids: list[int]
    ) -> int:
        """Validate prefix-hit blocks; return how many of them are free (ref 0)."""
        if state is not None and state.block_ids:
            raise ValueError(
                "new_computed_block_ids is only allowed while the request holds no blocks"
            )
        if not self.enable_caching:
            raise ValueError("new_computed_block_ids given but prefix caching is disabled")
        num_hits = len(hit_block_ids)
        if num_hits * self.block_size > len(request.all_token_ids):
            raise ValueError(
                f"new_computed_block_ids: {num_hits} blocks exceed the request's "
                f"{len(request.all_token_ids)} tokens"
            )
        hashes = state.block_hashes if state is not None else []
        self._hasher.extend(hashes, self._root_hash, request.all_token_ids, num_hits)
        blocks = self._blocks
        num_free = 0
        for i, block_id in enumerate(hit_block_ids):
            block = blocks[block_id]
            if block_id == 0 or block.block_hash != hashes[i]:
                raise ValueError(
                    f"new_computed_block_ids[{i}] = {block_id} no longer holds that prefix; "
                    "call get_computed_blocks() right before allocate_slots()"
                )
            num_free += block.ref_cnt == 0
        return num_free

    def _commit(self, state: _RequestState, token_ids: list[int], num_full: int) -> None:
        """Hash blocks num_committed_blocks..num_full-1 of the table into the prefix cache."""
        hashes = state.block_hashes
        if len(hashes) < num_full:
            self._hasher.extend(hashes, self._root_hash, token_ids, num_full)
        blocks = self._blocks
        block_ids = state.block_ids
        cached = self.pool.cached_blocks
        sink = self.pool.event_sink
        bs = self.block_size
        for i in range(state.num_committed_blocks, num_full):
            block = blocks[block_ids[i]]
            # A prefix hit is already hashed; content already cached in another block
            # (computed twice) keeps the existing entry and this block stays un-hashed.
            if block.block_hash is None and hashes[i] not in cached:
                block.block_hash = hashes[i]
                cached[hashes[i]] = block
                if sink is not None:
                    parent = hashes[i - 1] if i else None
                    sink.stored(hashes[i], parent, token_ids[i * bs : (i + 1) * bs])
        state.num_committed_blocks = num_full

    # ---- release --------------------------------------------------------------------

    def rollback(self, request: CacheRequest, num_tokens: int) -> int:
        """Shrink the request's KV to num_tokens; dropped blocks return to the pool now.

        Returns the new KV length: num_tokens, or num_tokens rounded down to a block
        boundary when the new last (partial) block is shared or hashed, because writing
        into it later would corrupt content other requests may read. The caller sets
        num_computed_tokens to the returned value.
        """
        state = self._requests.get(request.request_id)
        if state is None:
            if num_tokens != 0:
                _raise_beyond_capacity(num_tokens, 0)
            return 0
        block_ids = state.block_ids
        bs = self.block_size
        num_held = len(block_ids)
        if not 0 <= num_tokens <= num_held * bs:
            _raise_beyond_capacity(num_tokens, num_held * bs)
        num_kept = -(-num_tokens // bs)
        if num_tokens % bs:
            last = self._blocks[block_ids[num_kept - 1]]
            if last.ref_cnt > 1 or last.block_hash is not None:
                num_kept -= 1
                num_tokens = num_kept * bs
        if num_kept < num_held:
            blocks = self._blocks
            dropped = [blocks[i] for i in reversed(block_ids[num_kept:])]
            del block_ids[num_kept:]
            self.num_blocks_freed_by_rollback += self.pool.free(dropped)
        num_full = num_tokens // bs
        if state.num_committed_blocks > num_full:
            state.num_committed_blocks = num_full
        if len(state.block_hashes) > num_full:
            del state.block_hashes[num_full:]
        return num_tokens

    def free(self, request: CacheRequest) -> None:
        """Release all the request's blocks, tail first (the tail is evicted first).
        Idempotent: freeing twice or freeing an unknown request does nothing."""
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            blocks = self._blocks
            self.pool.free([blocks[i] for i in reversed(state.block_ids)])

    # ---- checks ---------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise RuntimeError if any pool or block-table invariant is broken."""
        check_integrity(self.pool, {rid: s.block_ids for rid, s in self._requests.items()})
