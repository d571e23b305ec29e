"""Paged KV cache operations shared by the attention backends.

Per layer the cache is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 = K, 1 = V); block 0 is the null block that pads block tables. Its dtype is
the model's, or bfloat16 under a float32 model (``--kv-cache-dtype bfloat16``): K/V are
rounded to it when written, and the backends widen what they gather to the query's.
"""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata


def write_plan(metadata: AttentionMetadata) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(token indices to write or None for all, their slots), skipping slot -1 padding.

    Done once per step: the boolean filter costs one host sync on CUDA, never per layer.
    """
    slots = metadata.slot_mapping
    valid = slots >= 0
    if bool(valid.all()):
        return None, slots
    token_idx = valid.nonzero().squeeze(1)  # [num_valid]
    return token_idx, slots.index_select(0, token_idx)


def write_kv(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    token_idx: torch.Tensor | None,
    slots: torch.Tensor,  # [num_written] int64
) -> None:
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, num_slots, kv_heads, head_dim]
    if token_idx is not None:
        key, value = key.index_select(0, token_idx), value.index_select(0, token_idx)
    if key.dtype != kv_cache.dtype:  # a bf16 cache under a float32 model
        key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    flat[0].index_copy_(0, slots, key)
    flat[1].index_copy_(0, slots, value)


def gather_kv(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [num_seqs, num_ctx_blocks] int64
) -> torch.Tensor:
    """Each sequence's context, padded to whole blocks: [2, num_seqs, padded_len, kv_heads, hd].

    Whole blocks are copied (contiguous runs of block_size * kv_heads * head_dim values),
    which is much cheaper than a per-token gather; callers mask the padded tail.
    """
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_seqs, num_ctx_blocks = block_ids.shape
    gathered = kv_cache.index_select(1, block_ids.view(-1))  # [2, seqs*blocks, bs, kv, hd]
    return gathered.view(2, num_seqs, num_ctx_blocks * block_size, num_kv_heads, head_dim)


def context_block_ids(metadata: AttentionMetadata) -> torch.Tensor:
    """[num_seqs, ceil(max_seq_len / block_size)] int64 block ids covering every context."""
    num_ctx_blocks = -(-metadata.max_seq_len // metadata.block_size)
    return metadata.block_tables[:, :num_ctx_blocks].long()
