"""ModelRunner: owns the model's tensors (weights, KV cache) and runs packed forwards.

It knows nothing of requests: callers hand it, per sequence, the tokens to feed, where
they start and the block table, and get back logits for the trailing positions they
asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.attention import allocate_kv_caches, kv_pool_view
from engine.attention.metadata import AttentionMetadata, as_mask_tensor, set_attention_metadata


@dataclass(slots=True)
class SeqInput:
    token_ids: list[int]  # fed this step: a prefill chunk, the last token, or last + drafts
    start_pos: int  # position of token_ids[0] == num_computed_tokens
    block_ids: list[int]  # block table covering start_pos + len(token_ids) slots
    num_logits: int  # trailing positions whose logits are needed (0 for a mid-prefill chunk)
    # A token tree's step: each fed token's RoPE position (a node's is the root's plus
    # its depth) and attention mask (AttentionMetadata.tree_masks); None: start_pos + j,
    # plain causal. The KV of fed token j goes to slot start_pos + j either way.
    positions: list[int] | None = None
    tree_mask: list[int] | None = None


class PreparedBatch(NamedTuple):
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    logit_rows: torch.Tensor | None  # [num_logits] rows of the hidden states to project


class ModelRunner:
    def __init__(
        self, loaded, num_blocks: int, block_size: int, kv_dtype: torch.dtype | None = None
    ) -> None:
        self.model = loaded.model
        self.arch = loaded.arch
        self.device = torch.device(loaded.device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_caches(
            self.arch.num_layers,
            num_blocks,
            block_size,
            self.arch.num_kv_heads,
            self.arch.head_dim,
            kv_dtype or loaded.dtype,  # --kv-cache-dtype; default the model's dtype
            self.device,
        )
        self.model.bind_kv_caches(self.kv_caches)
        # The caches are views of one allocation: every layer's slots in one view.
        self._pool = kv_pool_view(self.kv_caches)
        # hidden states -> logits in place of the model's compute_logits (a draft with
        # a reduced head keeps its reduced logits)
        self.logits_fn = None
        self._pin = self.device.type == "cuda"

    @torch.inference_mode()
    def move_kv(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Copy every layer's K and V from each source slot to its destination slot
        (slot = block id * block_size + offset): a token tree's accepted path into the
        slots plain decoding would have used. All sources are read before any write (the
        gather on the right is a copy), so a source may be another pair's destination.
        Checked on the host first: an out-of-range slot on CUDA would be a device assert."""
        if len(src_slots) != len(dst_slots):
            raise ValueError(
                f"move_kv needs one destination per source, got {len(src_slots)} sources "
                f"and {len(dst_slots)} destinations"
            )
        if not src_slots:
            return
        num_slots = self.num_blocks * self.block_size
        low, high = min(*src_slots, *dst_slots), max(*src_slots, *dst_slots)
        if low < 0 or high >= num_slots:
            raise ValueError(
                f"move_kv: slot {low if low < 0 else high} is outside 0..{num_slots - 1}"
            )
        pool = self._pool  # [layers, 2, num_blocks * block_size, kv_heads, head_dim]
        src = torch.tensor(src_slots, dtype=torch.long, device=self.device)
        dst = torch.tensor(dst_slots, dtype=torch.long, device=self.device)
        pool[:, :, dst] = pool[:, :, src]

    def forward(self, seqs: list[SeqInput]) -> torch.Tensor:
        """One packed forward. Returns logits [sum(num_logits), vocab_size] float32,
        sequence by sequence, positions in order."""
        return self.execute(self.prepare(seqs))

    @torch.inference_mode()
    def execute(self, prepared: PreparedBatch) -> torch.Tensor:
        input_ids, positions, metadata, logit_rows = prepared
        with set_attention_metadata(metadata):
            if self.logits_fn is None:  # the one-call decoder may run the head too
                return self.model.logits(input_ids, positions, logit_rows)
            hidden = self.model(input_ids, positions)  # [num_tokens, hidden_size]
        if logit_rows is not None:
            hidden = hidden[logit_rows]
        return self.logits_fn(hidden)

    def prepare(self, seqs: list[SeqInput]) -> PreparedBatch:
        """Host-side batch building: the packed tensors and the attention metadata."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logit_rows: list[int] = []
        max_blocks = max(len(s.block_ids) for s in seqs)
        block_tables: list[list[int]] = []
        tree_masks: list[int] | None = None
        if any(s.tree_mask is not None for s in seqs):
            tree_masks = []
            for s in seqs:
                tree_masks.extend(s.tree_mask or [-1] * len(s.token_ids))
        for s in seqs:
            n = len(s.token_ids)
            if s.positions is not None or s.tree_mask is not None:
                _check_tree_input(s)
            end = s.start_pos + n
            input_ids.extend(s.token_ids)
            positions.extend(range(s.start_pos, end) if s.positions is None else s.positions)
            blocks = s.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(s.start_pos, end))
            offset = query_start_loc[-1]
            logit_rows.extend(range(offset + n - s.num_logits, offset + n))
            query_start_loc.append(offset + n)
            seq_lens.append(end)
            query_lens.append(n)
            block_tables.append(blocks + [0] * (max_blocks - len(blocks)))
        all_rows = len(logit_rows) == len(input_ids)
        tensors = [
            torch.tensor(input_ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            torch.tensor(slots, dtype=torch.long),
            torch.tensor(query_start_loc, dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor(block_tables, dtype=torch.int32),
            torch.tensor(logit_rows, dtype=torch.long),
        ]
        if self._pin:
            tensors = [t.pin_memory() for t in tensors]
        ids_t, pos_t, slots_t, qsl_t, lens_t, tables_t, rows_t = (
            t.to(self.device, non_blocking=True) for t in tensors
        )
        metadata = AttentionMetadata(
            query_start_loc=qsl_t,
            seq_lens=lens_t,
            block_tables=tables_t,
            slot_mapping=slots_t,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            block_size=bs,
            tree_masks=None if tree_masks is None else as_mask_tensor(tree_masks, self.device),
        )
        return PreparedBatch(ids_t, pos_t, metadata, None if all_rows else rows_t)


def _check_tree_input(seq: SeqInput) -> None:
    """One position and one mask per fed token: a short list would shift every later
    sequence's masks onto the wrong tokens without any kernel noticing. And a mask
    cannot hide fed tokens from 64 on (one int64 per token: those are seen causally),
    so a mask that asks to is refused rather than silently widened."""
    n = len(seq.token_ids)
    for name, values in (("positions", seq.positions), ("tree_mask", seq.tree_mask)):
        if values is not None and len(values) != n:
            raise ValueError(f"SeqInput.{name} has {len(values)} entries for {n} fed tokens")
    for j in range(64, n if seq.tree_mask is not None else 0):
        wanted = (1 << (j - 63)) - 1  # fed tokens 64 .. j
        if (seq.tree_mask[j] >> 64) & wanted != wanted:
            raise ValueError(
                f"tree_mask of fed token {j} hides one of fed tokens 64..{j}: a mask "
                "holds 64 fed tokens, later ones are seen causally"
            )
