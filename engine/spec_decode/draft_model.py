"""Draft-model proposer: a small model with the target's tokenizer, its own paged KV
cache in its own block pool, run as a burst of k batched steps.

Draft cache bookkeeping per request (positions in the request's token sequence)::

    verified:  t_0 ... t_{m-1} | new verified tokens (1, or 2 after a full accept)
    draft KV:  [0, num_computed)  catch-up fed in burst step 1, then d_1 .. d_{k-1}

d_k is sampled but never fed, so after verification the draft KV is valid for the
longest prefix of what it was fed that matches the verified tokens; everything after
is rolled back and its blocks return to the draft pool at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from block_manager import KVCacheManager
from engine.config import EngineConfig
from engine.model_runner import ModelRunner, SeqInput
from engine.sampler import SamplingBatch, processed_probs, sample_from_probs
from engine.stats import PoolStats


def _num_params(loaded) -> int:
    return max(1, loaded.model.num_params)


def check_same_vocabulary(target_loaded, draft_loaded) -> None:
    """Draft tokens are target tokens: the two vocabularies must be identical."""
    t_size, d_size = target_loaded.arch.vocab_size, draft_loaded.arch.vocab_size
    if t_size != d_size:
        raise ValueError(
            f"draft model vocabulary ({d_size} tokens) differs from the target's ({t_size}); "
            "the draft model must share the target's tokenizer"
        )
    if target_loaded.tokenizer.get_vocab() != draft_loaded.tokenizer.get_vocab():
        raise ValueError(
            "draft model tokenizer differs from the target's (same size, different tokens); "
            "the draft model must share the target's tokenizer"
        )


@dataclass(slots=True, eq=False)
class _DraftRequest:
    """Satisfies block_manager.CacheRequest; shares the target's verified token list."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    fed: list[int] = field(default_factory=list)  # tokens fed since num_computed_tokens
    fed_start: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, draft_loaded, target_loaded, num_blocks: int) -> None:
        check_same_vocabulary(target_loaded, draft_loaded)
        self.loaded = draft_loaded
        self.device = torch.device(draft_loaded.device)
        self.kv = KVCacheManager(
            num_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            cache_key=f"draft:{draft_loaded.name}:{draft_loaded.dtype}",
        )
        self.runner = ModelRunner(draft_loaded, num_blocks, config.block_size)
        self.generator = torch.Generator(self.device).manual_seed(config.seed + 1)
        self._requests: dict[str, _DraftRequest] = {}
        # Proposing one draft token costs about one draft forward relative to a target
        # forward (both memory-bound at small batch); 0.02 covers the extra step
        # overhead. Verifying it is priced by the scheduler from measured steps.
        self.draft_cost = _num_params(draft_loaded) / _num_params(target_loaded) + 0.02

    # ---- the burst ------------------------------------------------------------------
    def propose(self, items, states):
        """k batched draft steps over every speculating request."""
        active: list[tuple[int, _DraftRequest, int]] = []  # (index, draft request, k)
        drafts: list[list[int]] = [[] for _ in items]
        probs: list[list[torch.Tensor]] = [[] for _ in items]
        for i, (item, state) in enumerate(zip(items, states)):
            dreq = self._draft_request(state.request)
            if self._reserve(dreq, item.num_spec_tokens):
                active.append((i, dreq, item.num_spec_tokens))
        step = 0
        while active:
            seqs = [self._step_input(dreq, drafts[i], step) for i, dreq, _ in active]
            logits = self.runner.forward(seqs)  # [len(active), vocab_size]
            batch = SamplingBatch.build(
                [states[i].params for i, _, _ in active],
                [states[i].generator for i, _, _ in active],
                self.device,
            )
            q = processed_probs(logits, batch)  # [len(active), vocab_size]
            tokens = sample_from_probs(q, batch, self.generator).tolist()
            for row, ((i, _, _), token) in enumerate(zip(active, tokens)):
                drafts[i].append(token)
                probs[i].append(q[row])
            step += 1
            active = [(i, d, k) for i, d, k in active if len(drafts[i]) < k]
        draft_probs = [torch.stack(p) if p else None for p in probs]
        return drafts, draft_probs

    def _draft_request(self, request) -> _DraftRequest:
        dreq = self._requests.get(request.request_id)
        if dreq is None:
            dreq = _DraftRequest(request.request_id, request.all_token_ids)
            self._requests[request.request_id] = dreq
        dreq.all_token_ids = request.all_token_ids  # re-bound after preemption
        return dreq

    def _reserve(self, dreq: _DraftRequest, k: int) -> bool:
        """Blocks for the catch-up tokens plus k - 1 fed drafts."""
        cached_ids, num_cached = [], 0
        if dreq.num_computed_tokens == 0 and not self.kv.get_block_ids(dreq.request_id):
            cached_ids, num_cached = self.kv.get_computed_blocks(dreq)
        num_new = dreq.num_tokens - dreq.num_computed_tokens - num_cached
        if self.kv.allocate_slots(dreq, num_new, k - 1, cached_ids) is None:
            return False
        dreq.num_computed_tokens += num_cached
        dreq.fed_start = dreq.num_computed_tokens
        dreq.fed = list(dreq.all_token_ids[dreq.num_computed_tokens :])
        return True

    def _step_input(self, dreq: _DraftRequest, drafts: list[int], step: int) -> SeqInput:
        block_ids = self.kv.get_block_ids(dreq.request_id)
        if step == 0:
            tokens = dreq.fed  # catch-up: verified tokens the draft has not seen
            return SeqInput(list(tokens), dreq.fed_start, block_ids, 1)
        dreq.fed.append(drafts[-1])
        return SeqInput([drafts[-1]], dreq.fed_start + len(dreq.fed) - 1, block_ids, 1)

    # ---- after verification ---------------------------------------------------------
    def on_verified(self, requests) -> None:
        for request in requests:
            dreq = self._requests.get(request.request_id)
            if dreq is None or not dreq.fed:
                continue
            verified = request.all_token_ids
            matched = 0
            for offset, token in enumerate(dreq.fed):
                position = dreq.fed_start + offset
                if position >= len(verified) or verified[position] != token:
                    break
                matched += 1
            dreq.all_token_ids = verified
            dreq.num_computed_tokens = self.kv.rollback(dreq, dreq.fed_start + matched)
            dreq.fed = []

    def free(self, request_id: str) -> None:
        dreq = self._requests.pop(request_id, None)
        if dreq is not None:
            self.kv.free(dreq)

    def pool_stats(self) -> PoolStats:
        kv = self.kv
        return PoolStats(
            num_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            num_blocks_in_use=kv.num_blocks - kv.num_free_blocks,
            usage=kv.usage,
            num_blocks_freed_by_rollback=kv.num_blocks_freed_by_rollback,
        )
