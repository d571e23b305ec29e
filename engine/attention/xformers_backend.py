"""GPU attention backend on xformers' memory-efficient attention.

xformers is imported lazily in ``__init__`` so that importing engine never needs it.
Each sequence's context is gathered block-wise into a padded key range
``[seq * kv_len, (seq + 1) * kv_len)`` and one ``BlockDiagonalCausalWithOffsetPaddedKeysMask``
covers the whole packed batch: queries of sequence i see only its first ``seq_lens[i]`` keys,
causally aligned to the bottom right (causal-with-offset), which is exactly what prefill
chunks, decodes and 1+k verification queries need.
"""

from __future__ import annotations

import torch

from engine.attention import torch_backend
from engine.attention.metadata import AttentionMetadata, get_attention_metadata
from engine.attention.paged import context_block_ids, gather_kv, write_kv, write_plan

XFORMERS_UNAVAILABLE = (
    "attention backend 'xformers' needs a CUDA GPU and the xformers package "
    "(pip install 'specserve[gpu]')"
)


class XFormersAttentionBackend:
    name = "xformers"

    def __init__(self, device: torch.device) -> None:
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(XFORMERS_UNAVAILABLE)
        try:
            from xformers.ops import fmha
        except ImportError as exc:
            raise RuntimeError(f"{XFORMERS_UNAVAILABLE}: {exc}") from None
        self.device = device
        self._fmha = fmha

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        metadata = get_attention_metadata()
        if metadata.tree_masks is not None:
            # A step that verifies a token tree: xformers' block-diagonal masks cannot say
            # which fed tokens each node sees, so the whole step runs on the torch
            # backend's SDPA with an explicit mask (same cache layout, same result up to
            # rounding; only tree steps pay it).
            plan = metadata.backend_plan("torch", torch_backend.make_plan)
            write_kv(kv_cache, key, value, plan.write_token_idx, plan.write_slots)
            return torch_backend.attend(query, kv_cache, metadata, plan, scale)
        plan = metadata.backend_plan(self.name, self._make_plan)
        token_idx, slots, block_ids, attn_bias = plan
        write_kv(kv_cache, key, value, token_idx, slots)
        kv = gather_kv(kv_cache, block_ids)  # [2, seqs, kv_len, kv_heads, hd]
        if kv.dtype != query.dtype:  # a bf16 cache under a float32 model: widened (exact)
            kv = kv.to(query.dtype)
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = kv.shape[3]
        group = num_heads // num_kv_heads
        # BMGHK layout: xformers handles GQA as groups (kv heads) x heads per group.
        q = query.view(1, num_tokens, num_kv_heads, group, head_dim)
        kv = kv.reshape(2, 1, -1, num_kv_heads, 1, head_dim)
        kv = kv.expand(2, 1, kv.shape[2], num_kv_heads, group, head_dim)
        out = self._fmha.memory_efficient_attention_forward(
            q, kv[0], kv[1], attn_bias=attn_bias, scale=scale
        )  # [1, num_tokens, kv_heads, group, hd]
        return out.reshape(num_tokens, num_heads * head_dim)

    def _make_plan(self, metadata: AttentionMetadata) -> tuple:
        token_idx, slots = write_plan(metadata)
        block_ids = context_block_ids(metadata)
        kv_len = block_ids.shape[1] * metadata.block_size
        mask_cls = self._fmha.attn_bias.BlockDiagonalCausalWithOffsetPaddedKeysMask
        seqlens = dict(
            q_seqlen=metadata.query_lens_cpu, kv_padding=kv_len, kv_seqlen=metadata.seq_lens_cpu
        )
        try:
            attn_bias = mask_cls.from_seqlens(**seqlens, device=self.device)
        except TypeError:  # xformers before 0.0.28 has no device argument
            attn_bias = mask_cls.from_seqlens(**seqlens).to(self.device)
        return token_idx, slots, block_ids, attn_bias
