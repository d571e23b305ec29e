"""Proposers give each speculating request up to k draft tokens per step.

Interface (duck-typed; the engine calls nothing else):
    propose(items, states) -> (drafts per item, draft probs per item or None)
    on_verified(requests)  -> after the scheduler applied a step's results
    free(request_id)       -> the request finished, was aborted or preempted
    pool_stats()           -> PoolStats of its own KV pool, or None
    draft_cost             -> one draft token's cost in target steps (for adaptive k)
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.spec_decode.ngram import NgramProposer


class NgramSpecProposer:
    """Deterministic drafts: q is one-hot, so draft_probs is None."""

    draft_cost = 0.01  # numpy matching on the host (verification is priced by the scheduler)

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self._ngram = NgramProposer(ngram_min, ngram_max)

    def propose(self, items, states):
        drafts = [
            self._ngram.propose(state.request.all_token_ids, item.num_spec_tokens)
            for item, state in zip(items, states)
        ]
        return drafts, None

    def on_verified(self, requests) -> None:
        pass

    def free(self, request_id: str) -> None:
        pass

    def pool_stats(self):
        return None


def build_proposer(method: str, config: EngineConfig, target_loaded, draft_loaded, num_blocks: int):
    if method == "none":
        return None
    if method == "ngram":
        return NgramSpecProposer(config.ngram_min, config.ngram_max)
    from engine.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(config, draft_loaded, target_loaded, num_blocks)
