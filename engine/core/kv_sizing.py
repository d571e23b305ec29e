"""How many KV blocks to allocate, and the context length that follows from it.

The target and the draft pools hold the same number of blocks (a draft must cache
every token the target does) and are sized together from one memory budget, so a
draft model can never silently eat the target's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.attention import kv_cache_bytes_per_block
from engine.config import EngineConfig


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int  # per pool, the null block included
    max_model_len: int
    bytes_per_block: int  # target + draft together


def _bytes_per_block(loaded, block_size: int, kv_dtype=None) -> int:
    arch = loaded.arch
    return kv_cache_bytes_per_block(
        arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim, kv_dtype or loaded.dtype
    )


def _context_limit(loaded, which: str) -> tuple[int, str]:
    """The longest context ``loaded`` serves, and what sets it."""
    limit = loaded.arch.max_position_embeddings
    name = f"the {which}'s max_position_embeddings"
    window = loaded.arch.sliding_window
    if window is not None and window < limit:
        # Full attention equals sliding-window attention only inside the window.
        limit, name = window, f"the {which}'s sliding_window (not implemented beyond)"
    return limit, name


def plan_kv_cache(config: EngineConfig, loaded, draft_loaded=None) -> KVCachePlan:
    from engine.loader import resolve_kv_cache_dtype

    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, loaded.dtype)
    per_block = _bytes_per_block(loaded, config.block_size, kv_dtype)
    if draft_loaded is not None:
        per_block += _bytes_per_block(draft_loaded, config.block_size)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    else:
        num_blocks = config.kv_cache_memory_bytes // per_block
        if num_blocks < 2:
            raise ValueError(
                f"kv_cache_memory_gib={config.kv_cache_memory_gib} holds {num_blocks} KV blocks "
                f"of {per_block} bytes; at least 2 are needed"
            )
    model_max, limit_name = _context_limit(loaded, "model")
    if draft_loaded is not None:
        # The draft caches every token the target does: the pair's context is the shorter.
        draft_max, draft_name = _context_limit(draft_loaded, "draft model")
        if draft_max < model_max:
            model_max, limit_name = draft_max, draft_name
    max_model_len = config.max_model_len or model_max
    if max_model_len > model_max:
        raise ValueError(
            f"max_model_len must be <= {model_max} ({limit_name}), got {max_model_len}"
        )
    # One request alone must always fit, or preemption could never make room for it.
    capacity = (num_blocks - 1) * config.block_size
    return KVCachePlan(num_blocks, min(max_model_len, capacity), per_block)
