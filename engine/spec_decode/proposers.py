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


class HybridProposer:
    """n-gram drafts where the context repeats itself, the draft model's elsewhere.

    A request whose last ``min_match`` or more tokens occurred earlier (the model is
    copying from its prompt or its own output: summaries, extraction, code edits) takes
    the continuation of that occurrence, which a small draft model predicts worse and
    costs more to run. Every other speculating request goes to the draft model, which
    catches up on the tokens it skipped the next time it proposes. Each request's k
    stays adaptive: its acceptance history covers whichever proposer served it.
    """

    def __init__(self, ngram: NgramProposer, draft, min_match: int = 3) -> None:
        self._ngram = ngram
        self._draft = draft
        self.min_match = min_match
        self.draft_cost = draft.draft_cost

    def propose(self, items, states):
        drafts: list[list[int]] = [[] for _ in items]
        probs: list = [None] * len(items)
        to_model = []
        for i, (item, state) in enumerate(zip(items, states)):
            tokens, matched = self._ngram.propose_with_match(
                state.request.all_token_ids, item.num_spec_tokens
            )
            if tokens and matched >= self.min_match:
                drafts[i] = tokens
            else:
                to_model.append(i)
        if to_model:
            model_drafts, model_probs = self._draft.propose(
                [items[i] for i in to_model], [states[i] for i in to_model]
            )
            for i, tokens, p in zip(to_model, model_drafts, model_probs):
                drafts[i], probs[i] = tokens, p
        return drafts, probs

    def on_verified(self, requests) -> None:
        self._draft.on_verified(requests)

    def free(self, request_id: str) -> None:
        self._draft.free(request_id)

    def pool_stats(self):
        return self._draft.pool_stats()


def build_proposer(method: str, config: EngineConfig, target_loaded, draft_loaded, num_blocks: int):
    if method == "none":
        return None
    if method == "ngram":
        return NgramSpecProposer(config.ngram_min, config.ngram_max)
    from engine.spec_decode.draft_model import DraftModelProposer

    draft = DraftModelProposer(config, draft_loaded, target_loaded, num_blocks)
    if method == "hybrid":
        return HybridProposer(NgramProposer(config.ngram_min, config.ngram_max), draft)
    return draft
