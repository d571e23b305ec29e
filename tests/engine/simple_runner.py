"""A minimal paged-cache driver for the model parity tests.

Not the engine's model runner: no scheduler, no sampling beyond greedy. It owns a KV
cache, hands out blocks from a shuffled free list (so block tables are non-contiguous
and paging bugs show) and runs packed steps of arbitrary (sequence, new tokens) chunks.
"""

from __future__ import annotations

import random

import torch

from engine.attention import allocate_kv_caches, build_attention_metadata, set_attention_metadata


class SimplePagedRunner:
    def __init__(
        self,
        model,
        num_blocks: int = 256,
        block_size: int = 16,
        seed: int = 0,
        kv_dtype: torch.dtype | None = None,  # default the model's
    ):
        param = next(model.parameters())
        self.model = model
        self.device, self.dtype = param.device, param.dtype
        self.block_size = block_size
        cfg = model.config
        caches = allocate_kv_caches(
            cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
            kv_dtype or self.dtype, self.device,
        )  # fmt: skip
        model.bind_kv_caches(caches)
        self.free_blocks = list(range(1, num_blocks))  # block 0 is the null block
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.seq_lens: dict[int, int] = {}

    def add_sequence(self, seq_id: int) -> None:
        self.block_tables[seq_id] = []
        self.seq_lens[seq_id] = 0

    def free_sequence(self, seq_id: int) -> None:
        self.free_blocks.extend(self.block_tables.pop(seq_id))
        del self.seq_lens[seq_id]

    @torch.inference_mode()
    def step(self, chunks: list[tuple[int, list[int]]], all_logits: bool = False) -> torch.Tensor:
        """Append each chunk's tokens to its sequence in one packed forward.

        Returns logits [num_tokens, vocab] if ``all_logits`` else [num_chunks, vocab] for
        the last token of each chunk.
        """
        query_lens, seq_lens, tables, token_ids, positions = [], [], [], [], []
        for seq_id, new_tokens in chunks:
            start = self.seq_lens[seq_id]
            end = start + len(new_tokens)
            self._grow(seq_id, end)
            self.seq_lens[seq_id] = end
            query_lens.append(len(new_tokens))
            seq_lens.append(end)
            tables.append(self.block_tables[seq_id])
            token_ids += new_tokens
            positions += range(start, end)
        metadata = build_attention_metadata(
            query_lens, seq_lens, tables, self.block_size, self.device
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        rows = None if all_logits else metadata.query_start_loc[1:].long() - 1
        with set_attention_metadata(metadata):  # the one-call decoder may run the head too
            return self.model.logits(input_ids, pos, rows)

    def _grow(self, seq_id: int, num_tokens: int) -> None:
        table = self.block_tables[seq_id]
        while len(table) * self.block_size < num_tokens:
            if not self.free_blocks:
                raise RuntimeError("SimplePagedRunner ran out of KV blocks")
            table.append(self.free_blocks.pop())

    def generate_greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation of every prompt: one packed prefill, then batched decodes."""
        seq_ids = list(range(len(prompts)))
        for seq_id in seq_ids:
            self.add_sequence(seq_id)
        outputs: list[list[int]] = [[] for _ in prompts]
        logits = self.step(list(zip(seq_ids, prompts, strict=True)))
        for _ in range(max_new_tokens):
            next_ids = logits.argmax(-1).tolist()
            for out, token in zip(outputs, next_ids, strict=True):
                out.append(token)
            if len(outputs[0]) == max_new_tokens:
                break
            logits = self.step([(s, [t]) for s, t in zip(seq_ids, next_ids, strict=True)])
        for seq_id in seq_ids:
            self.free_sequence(seq_id)
        return outputs
