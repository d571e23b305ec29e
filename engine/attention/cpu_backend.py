"""CPU attention backend (float32 or bfloat16): specserve's compiled paged-attention
kernel.

Every query (decode, 1 + k verification, a token tree, a prefill chunk) is computed
straight from the paged cache by ``engine/kernels/cpu_kernels.c``: no gather of the
context into a padded copy, no mask, each K/V block read once per KV head, in float32
and bfloat16 alike (``_make_plan`` says why). ``split_plan`` keeps the split float32
used before (queries over ``SHORT_QUERY_MAX`` tokens on the torch backend's SDPA,
batched among themselves, both halves writing into one output in packed order) for
measuring it.

Measured on the 2-core CI machine (SmolLM2-135M, 32 decoding requests, contexts of
~40-100 tokens, `specserve bench step`): attention fell from 22-35 ms to 8-10 ms per
step of 30 layers, where it is bound by reading the fp32 K/V (docs/benchmarks.md). A
bfloat16 model has a bfloat16 cache, half the bytes to read; the kernel widens keys and
values to fp32 as it reads them and accumulates in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from engine.attention import torch_backend
from engine.attention.metadata import (
    AttentionMetadata,
    build_attention_metadata,
    get_attention_metadata,
)
from engine.kernels.cpu import CpuKernels

# split_plan's longest kernel query before float32 went all-kernel. Measured on
# the 2-core CI machine, 4 sequences, 9 heads / 3 KV heads of 64, contexts 128 / 512:
# kernel vs gather + SDPA 43 vs 187 us at 1 query token, 260 vs 350 us at 16, even at
# ~24-32, SDPA ahead from 32 at long contexts.
SHORT_QUERY_MAX = 16


@dataclass(slots=True)
class _LongPart:
    token_idx: torch.Tensor  # [num_long_tokens] packed positions of the long queries
    metadata: AttentionMetadata  # the long sequences alone, as their own batch
    plan: object  # the torch backend's plan for that batch


@dataclass(slots=True)
class _Plan:
    short_ids: torch.Tensor | None  # [num_short] int32 sequence indices, or None
    short_max_query_len: int
    long: _LongPart | None


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self, device: torch.device, kernels: CpuKernels) -> None:
        self.device = torch.device(device)
        if self.device.type != "cpu":
            raise ValueError(f"the cpu attention backend runs on the CPU, not {self.device}")
        self.kernels = kernels

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        metadata = get_attention_metadata()
        plan = metadata.backend_plan(
            f"{self.name}-{query.dtype}", partial(_make_plan, dtype=query.dtype)
        )
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        self.kernels.write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
        num_tokens, num_heads, head_dim = query.shape
        out = query.new_empty(num_tokens, num_heads, head_dim)
        if plan.short_ids is not None:
            self.kernels.paged_attention(
                out,
                query,
                k_cache,
                v_cache,
                metadata.block_tables,
                metadata.seq_lens,
                metadata.query_start_loc,
                plan.short_ids,
                plan.short_max_query_len,
                scale,
                metadata.tree_masks,
            )
        if plan.long is not None:
            long = plan.long
            long_out = torch_backend.attend(
                query.index_select(0, long.token_idx), kv_cache, long.metadata, long.plan, scale
            )
            out.view(num_tokens, -1).index_copy_(0, long.token_idx, long_out)
        return out.view(num_tokens, num_heads * head_dim)

    def kernel_plan(
        self, metadata: AttentionMetadata, dtype: torch.dtype
    ) -> tuple[torch.Tensor, int] | None:
        """(sequence ids, longest query) when every query of this step runs on the
        kernel, as it does in bfloat16; else None. Shares the layers' cached plan."""
        plan = metadata.backend_plan(f"{self.name}-{dtype}", partial(_make_plan, dtype=dtype))
        if plan.long is not None or plan.short_ids is None:
            return None
        return plan.short_ids, plan.short_max_query_len


def _make_plan(metadata: AttentionMetadata, dtype: torch.dtype) -> _Plan:
    # Every query through the kernel, in float32 and bfloat16 alike: were long prefill
    # chunks computed by SDPA and short ones by the kernel, a row's rounding would
    # depend on the chunk it was scheduled in (a prefix-cache hit or a chunked prefill
    # makes the same prompt's last chunk short), and the ulp by which the two disagree
    # flips near-tied argmaxes: the same greedy request, sent twice, answered
    # differently the second time (the stress test met it in float32). One kernel keeps
    # every greedy and seeded output independent of chunking, batching and speculation.
    # What it costs at prefill: nothing up to ~512-token prompts, 1.35x on a 1500-token
    # one in float32 (docs/benchmarks.md, "One attention kernel for every query").
    return split_plan(metadata, max(metadata.query_lens_cpu, default=0))


def split_plan(metadata: AttentionMetadata, limit: int) -> _Plan:
    """Queries of up to ``limit`` tokens on the kernel, longer ones on SDPA (batched
    among themselves): the split float32 used before, kept for measuring it."""
    q_lens = metadata.query_lens_cpu
    short = [i for i, q in enumerate(q_lens) if q <= limit]
    long = [i for i, q in enumerate(q_lens) if q > limit]
    short_ids = torch.tensor(short, dtype=torch.int32) if short else None
    short_max = max((q_lens[i] for i in short), default=0)
    if not long:
        return _Plan(short_ids, short_max, None)
    starts = metadata.query_start_loc.tolist()
    token_idx = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in long])
    tables = metadata.block_tables.tolist()
    sub = build_attention_metadata(
        [q_lens[i] for i in long],
        [metadata.seq_lens_cpu[i] for i in long],
        [tables[i] for i in long],
        metadata.block_size,
        tree_masks=None if metadata.tree_masks is None else metadata.tree_masks[token_idx],
    )
    return _Plan(short_ids, short_max, _LongPart(token_idx, sub, torch_backend.make_plan(sub)))
