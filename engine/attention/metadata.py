"""Per-step attention metadata, installed for the duration of one forward pass.

The model's signature stays ``forward(input_ids, positions)``; attention layers read the
batch layout from here. One instance describes one packed batch: sequence ``i`` owns
query tokens ``query_start_loc[i]:query_start_loc[i + 1]`` of the packed ``input_ids``,
and after this step its KV cache holds ``seq_lens[i]`` tokens (cached + new).

    packed tokens:  | seq 0 (prefill chunk, 5) | seq 1 (decode, 1) | seq 2 (verify, 1+k) |
    query_start_loc: 0                          5                   6                   6+1+k
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, on the model's device
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0 (null block)
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = padding, never written
    # Host copies: backends plan with these so they never sync with the device.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    # Token trees: per packed token, which of its sequence's tokens fed this step it
    # sees (bit b: fed token b; -1: every earlier one, plain causal; fed tokens 64 on are
    # seen by the causal rule alone), on top of the context before the step. None when
    # no sequence of the step verifies a tree (engine/spec_decode/paths.py makes them).
    tree_masks: torch.Tensor | None = None  # [num_tokens] int64
    # Backend-private tensors derived once per step and shared by every layer
    # (gather indices, masks, xformers bias objects). Keyed by backend name.
    backend_cache: dict[str, Any] = field(default_factory=dict)

    def backend_plan(self, name: str, make: Callable[[AttentionMetadata], Any]) -> Any:
        """The plan backend ``name`` derives from this step's layout, built by the first
        layer that asks and reused by every other."""
        plan = self.backend_cache.get(name)
        if plan is None:
            plan = self.backend_cache[name] = make(self)
        return plan

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)


# Per thread: two engines in one process (two servers, a server and an offline LLM)
# each run their forward passes on their own thread.
_local = threading.local()


@contextlib.contextmanager
def set_attention_metadata(metadata: AttentionMetadata) -> Iterator[AttentionMetadata]:
    """Install ``metadata`` for one forward pass on this thread. Nesting is a bug and is
    refused."""
    if getattr(_local, "current", None) is not None:
        raise RuntimeError("attention metadata is already set: forward passes cannot nest")
    _local.current = metadata
    try:
        yield metadata
    finally:
        _local.current = None


def get_attention_metadata() -> AttentionMetadata:
    current = getattr(_local, "current", None)
    if current is None:
        raise RuntimeError(
            "no attention metadata set: call the model inside set_attention_metadata()"
        )
    return current


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    tree_masks: torch.Tensor | list[int] | None = None,
) -> AttentionMetadata:
    """Build the metadata of one packed step from host-side lists.

    Sequence ``i`` adds ``query_lens[i]`` tokens and holds ``seq_lens[i]`` after the step,
    so its new tokens sit at positions ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``
    and land in the slots its block table maps those positions to.
    """
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ValueError(
            f"query_lens ({len(query_lens)}), seq_lens ({len(seq_lens)}) and block_tables "
            f"({len(block_tables)}) must have one entry per sequence"
        )
    slots: list[int] = []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        if not 0 < q_len <= s_len <= len(table) * block_size:
            raise ValueError(
                f"need 0 < query_len ({q_len}) <= seq_len ({s_len}) <= "
                f"len(block_table) * block_size ({len(table) * block_size})"
            )
        for pos in range(s_len - q_len, s_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    max_blocks = max((len(t) for t in block_tables), default=0)
    padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device).view(
            len(block_tables), max_blocks
        ),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        block_size=block_size,
        tree_masks=None if tree_masks is None else as_mask_tensor(tree_masks, device),
    )


_MASK_BITS = (1 << 64) - 1  # a mask as the uint64 the kernels read


def as_mask_tensor(masks: torch.Tensor | list[int], device: torch.device | str) -> torch.Tensor:
    """Tree masks as int64: a Python mask's bits 64 and up are dropped (fed tokens from
    64 on are seen by the causal rule alone, so those bits say nothing, and a tree of
    more than 64 fed tokens would otherwise overflow), and one with bit 63 set wraps to
    a negative int64."""
    if isinstance(masks, torch.Tensor):
        return masks.to(device=device, dtype=torch.int64)
    low = [m & _MASK_BITS for m in masks]
    signed = [m - (1 << 64) if m >= 1 << 63 else m for m in low]
    return torch.tensor(signed, dtype=torch.int64, device=device)
