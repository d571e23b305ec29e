"""Reference attention backend: gather each sequence's blocks, run torch SDPA.

Works on CPU and GPU. Everything that depends only on the batch layout (write slots,
block ids, query padding indices, the mask) is planned once per step, cached in
``metadata.backend_cache["torch"]`` and reused by every layer, so a layer costs one KV
write, one block gather and one SDPA call.

Causal-with-offset: query ``j`` of a sequence with ``q`` new tokens and ``s`` context
tokens sits at position ``s - q + j`` and sees keys ``0 .. s - q + j``:

    keys:     0 1 2 3 4 5 6      (s = 7, q = 3)
    query 0:  x x x x x . .
    query 1:  x x x x x x .
    query 2:  x x x x x x x
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata, get_attention_metadata
from engine.attention.paged import context_block_ids, gather_kv, write_kv, write_plan


@dataclass(slots=True)
class _Plan:
    write_token_idx: torch.Tensor | None  # [num_valid] or None: every token is written
    write_slots: torch.Tensor  # [num_valid] int64
    block_ids: torch.Tensor  # [num_seqs, num_ctx_blocks] int64
    kv_len: int  # keys per sequence handed to SDPA (exact for one sequence, else padded)
    mask: torch.Tensor | None  # [num_seqs, 1, max_query_len, kv_len] bool; True = attend
    is_causal: bool  # one sequence whose whole context is new (plain causal prefill)
    query_pad_idx: torch.Tensor | None  # [num_seqs, max_query_len]: packed token per row
    out_idx: torch.Tensor | None  # [num_tokens]: padded row of each packed token


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        metadata = get_attention_metadata()
        plan = metadata.backend_plan(self.name, make_plan)
        write_kv(kv_cache, key, value, plan.write_token_idx, plan.write_slots)
        return attend(query, kv_cache, metadata, plan, scale)


def attend(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    plan: _Plan,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
    """Gather each sequence's context (already written) and run SDPA over it."""
    kv = gather_kv(kv_cache, plan.block_ids)[:, :, : plan.kv_len]  # [2, seqs, kv_len, kvh, hd]
    if kv.dtype != query.dtype:  # a bf16 cache under a float32 model: widened (exact)
        kv = kv.to(query.dtype)
    k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [seqs, kv_heads, kv_len, hd]
    num_tokens, num_heads, head_dim = query.shape
    if metadata.max_query_len == 1:
        out = _decode_attention(query, k, v, plan.mask, scale)
        return out.reshape(num_tokens, num_heads * head_dim)
    q = _pad_queries(query, metadata, plan)  # [seqs, heads, max_query_len, hd]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=plan.mask, is_causal=plan.is_causal, scale=scale, enable_gqa=True
    )  # [seqs, heads, max_query_len, hd]
    out = out.transpose(1, 2).reshape(-1, num_heads * head_dim)  # [seqs * max_q, h * hd]
    if plan.out_idx is not None:
        out = out.index_select(0, plan.out_idx)
    return out  # [num_tokens, num_heads * head_dim]


def _decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one new token per sequence
    k: torch.Tensor,  # [num_seqs, num_kv_heads, kv_len, head_dim]
    v: torch.Tensor,  # [num_seqs, num_kv_heads, kv_len, head_dim]
    mask: torch.Tensor | None,  # [num_seqs, 1, 1, kv_len]
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_kv_heads, group, head_dim]
    # The query heads sharing a KV head become that head's query rows: GQA without
    # repeating K/V, and the key-padding mask broadcasts over the rows.
    num_seqs, num_heads, head_dim = query.shape
    q = query.view(num_seqs, k.shape[1], num_heads // k.shape[1], head_dim)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _pad_queries(
    query: torch.Tensor, metadata: AttentionMetadata, plan: _Plan
) -> torch.Tensor:  # [num_seqs, num_heads, max_query_len, head_dim]
    if metadata.num_seqs == 1:
        return query.transpose(0, 1).unsqueeze(0)
    num_seqs, max_query_len = plan.query_pad_idx.shape
    padded = query.index_select(0, plan.query_pad_idx.view(-1))  # [seqs * max_q, heads, hd]
    return padded.view(num_seqs, max_query_len, *query.shape[1:]).transpose(1, 2)


def make_plan(metadata: AttentionMetadata) -> _Plan:
    write_token_idx, write_slots = write_plan(metadata)
    block_ids = context_block_ids(metadata)
    q_lens, s_lens = metadata.query_lens_cpu, metadata.seq_lens_cpu
    tree = metadata.tree_masks is not None  # a token tree: an explicit mask, always
    if metadata.num_seqs == 1 and not tree:
        # No padding at all: slice the context exactly; mask only a partial causal prefill.
        q_len, s_len = q_lens[0], s_lens[0]
        is_causal = 1 < q_len == s_len
        mask = None if q_len == 1 or is_causal else _causal_mask([q_len], [s_len], s_len)
        mask = None if mask is None else mask.to(metadata.seq_lens.device)
        return _Plan(write_token_idx, write_slots, block_ids, s_len, mask, is_causal, None, None)
    kv_len = s_lens[0] if metadata.num_seqs == 1 else block_ids.shape[1] * metadata.block_size
    device = metadata.seq_lens.device
    mask = None
    if metadata.max_query_len == 1 and not tree:
        if min(s_lens) != kv_len:  # keys past each context end are padding
            mask = _causal_mask(q_lens, s_lens, kv_len).to(device)
        return _Plan(write_token_idx, write_slots, block_ids, kv_len, mask, False, None, None)
    mask = _tree_mask(metadata, kv_len) if tree else _causal_mask(q_lens, s_lens, kv_len)
    query_pad_idx, out_idx = _query_padding(q_lens)
    return _Plan(
        write_token_idx,
        write_slots,
        block_ids,
        kv_len,
        mask.to(device),
        False,
        query_pad_idx.to(device),
        out_idx.to(device),
    )


def _causal_mask(q_lens: list[int], s_lens: list[int], kv_len: int) -> torch.Tensor:
    """[num_seqs, 1, max_query_len, kv_len] bool, causal with offset, padding excluded.

    Padded query rows (j >= q_len) attend like the last real query, so no row is fully
    masked (a fully masked row turns into NaN); their outputs are dropped anyway.
    """
    q = torch.tensor(q_lens)
    s = torch.tensor(s_lens)
    j = torch.arange(max(q_lens))
    query_pos = torch.minimum((s - q)[:, None] + j[None, :], (s - 1)[:, None])  # [seqs, max_q]
    key_pos = torch.arange(kv_len)
    return (key_pos[None, None, :] <= query_pos[:, :, None]).unsqueeze(1)


def _tree_mask(metadata: AttentionMetadata, kv_len: int) -> torch.Tensor:
    """``_causal_mask`` where, among the keys fed this step, each query sees only the
    fed tokens its tree mask names (AttentionMetadata.tree_masks)."""
    q_lens, s_lens = metadata.query_lens_cpu, metadata.seq_lens_cpu
    causal = _causal_mask(q_lens, s_lens, kv_len)  # [seqs, 1, max_q, kv_len]
    pad_idx, _ = _query_padding(q_lens)
    masks = metadata.tree_masks.cpu()[pad_idx]  # [seqs, max_q]: padded rows repeat the last
    step_start = torch.tensor(s_lens) - torch.tensor(q_lens)  # [seqs]
    fed = torch.arange(kv_len)[None, :] - step_start[:, None]  # [seqs, kv_len]
    in_tree = (fed >= 0) & (fed < 64)
    bit = (masks[:, :, None] >> fed.clamp(0, 63)[:, None, :]) & 1  # [seqs, max_q, kv_len]
    seen = ~in_tree[:, None, :] | (bit == 1)
    return causal & seen.unsqueeze(1)


def _query_padding(q_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed token index for each padded row, padded row of each packed token)."""
    max_q = max(q_lens)
    q = torch.tensor(q_lens)
    starts = torch.cumsum(q, 0) - q  # [seqs]
    j = torch.arange(max_q)
    pad_idx = starts[:, None] + torch.minimum(j[None, :], (q - 1)[:, None])  # [seqs, max_q]
    rows = torch.arange(len(q_lens) * max_q).view(len(q_lens), max_q)
    out_idx = rows[j[None, :] < q[:, None]]  # [num_tokens], row-major = packed order
    return pad_idx, out_idx
