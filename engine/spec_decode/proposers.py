"""Proposers give each speculating request up to k draft tokens per step.

Interface (duck-typed; the engine calls nothing else):
    propose(items, states) -> (drafts per item, draft probs per item or None)
    on_verified(requests)  -> after the scheduler applied a step's results
    free(request_id)       -> the request finished, was aborted or preempted
    pool_stats()           -> PoolStats of its own KV pool, or None
    draft_cost             -> one draft token's cost in target steps (for adaptive k)
Optional: update_cost(batch_size, target StepCostModel) -> draft_cost measured now
(a draft model's timed bursts), on_target_forward(items, seqs) after each target
forward (an EAGLE draft keeps the target's features), max_catchup (the most verified
tokens a request's draft was fed in the last propose: a draft's prefill when large).
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.io.sampling_params import MAX_NUM_SPECULATIVE_TOKENS
from engine.spec_decode.ngram import NgramProposer
from scheduler.spec_length import AcceptanceHistory

# A match of this many tokens or more is a copied span ("ngram"); a shorter one
# ("ngram-short") is right far less often. Each keeps its own acceptance history per
# request and its own lane in the speculation gate.
LONG_MATCH = 3


class NgramSpecProposer:
    """Deterministic drafts: q is one-hot, so draft_probs is None."""

    draft_cost = 0.01  # an index lookup on the host (verification is priced by the scheduler)

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self._ngram = NgramProposer(ngram_min, ngram_max)

    def source_for(self, request, max_k: int = MAX_NUM_SPECULATIVE_TOKENS) -> tuple[str, float]:
        """("ngram" for a copied span, "ngram-short" otherwise; the cost per draft)."""
        _, matched = self._ngram.propose_for(request.request_id, request.all_token_ids, max_k)
        return ("ngram" if matched >= LONG_MATCH else "ngram-short"), self.draft_cost

    def propose(self, items, states):
        drafts = [
            self._ngram.propose_for(
                state.request.request_id, state.request.all_token_ids, item.num_spec_tokens
            )[0]
            for item, state in zip(items, states)
        ]
        return drafts, None

    def on_verified(self, requests) -> None:
        pass

    def free(self, request_id: str) -> None:
        self._ngram.forget(request_id)

    def pool_stats(self):
        return None


def _engine_wide_acceptance(prior_rate: float) -> AcceptanceHistory:
    """One proposer's per-token acceptance over every request, decayed slowly: adaptive
    k's estimate, with a prior worth 4 drafts."""
    return AcceptanceHistory(accepted=4.0 * prior_rate, trials=4.0, decay=0.98)


class HybridProposer:
    """n-gram drafts where the context repeats itself, the draft model's elsewhere.

    A request whose last ``min_match`` or more tokens occurred earlier (the model is
    copying from its prompt or its own output: summaries, extraction, code edits) takes
    the continuation of that occurrence: such drafts are accepted far more often than
    any small model's. Where n-gram lookup only matches a token or two, or nothing, the
    proposer with the better acceptance so far gets the request: the engine keeps one
    decayed acceptance estimate for short n-gram matches and one for the draft model,
    fed by every verification, and hands every ``explore_every``-th such request to the
    other one so both estimates stay current. The draft model catches up on the tokens
    it skipped the next time it proposes.

    The choice is made before k (``source_for``, called by the scheduler), so each
    request keeps one acceptance history per proposer: the draft model's rejections do
    not shorten the n-gram runs of a request that copies its prompt, nor the other way
    round. ``propose`` uses the choice ``source_for`` made for the request this step.
    """

    def __init__(
        self, ngram: NgramProposer, draft, min_match: int = LONG_MATCH, explore_every: int = 8
    ):
        self._ngram = ngram
        self._draft = draft
        self.min_match = min_match
        self.explore_every = explore_every
        self.draft_cost = draft.draft_cost
        self.short_ngram = _engine_wide_acceptance(prior_rate=0.3)
        self.model = _engine_wide_acceptance(prior_rate=0.5)
        self._decisions = 0
        # request id -> (number of tokens when decided, source, n-gram drafts)
        self._decided: dict[str, tuple[int, str, list[int]]] = {}
        # request id -> (the estimate to credit, drafts proposed, accepted before)
        self._pending: dict[str, tuple[AcceptanceHistory | None, int, int]] = {}

    def source_for(self, request, max_k: int = MAX_NUM_SPECULATIVE_TOKENS) -> tuple[str, float]:
        """(which proposer drafts for ``request`` this step, its cost per draft)."""
        tokens, matched = self._ngram.propose_for(request.request_id, request.all_token_ids, max_k)
        if tokens and matched >= self.min_match:
            source = "ngram"
        elif tokens and self._short_match_wins():
            source = "ngram-short"
        else:
            source = "model"
        self._decided[request.request_id] = (request.num_tokens, source, tokens)
        cost = self.draft_cost if source == "model" else NgramSpecProposer.draft_cost
        return source, cost

    def propose(self, items, states):
        drafts: list[list[int]] = [[] for _ in items]
        probs: list = [None] * len(items)
        to_model = []
        for i, (item, state) in enumerate(zip(items, states)):
            request = state.request
            decided = self._decided.get(request.request_id)
            if decided is None or decided[0] != request.num_tokens:  # fixed-k requests
                self.source_for(request)
                decided = self._decided[request.request_id]
            _, source, tokens = decided
            if source == "model":
                to_model.append(i)
                continue
            drafts[i] = tokens[: item.num_spec_tokens]
            estimate = self.short_ngram if source == "ngram-short" else None
            self._pending[request.request_id] = (
                estimate,
                len(drafts[i]),
                request.num_accepted_tokens,
            )
        self._decided.clear()
        self._draft.max_catchup = 0
        if to_model:
            model_drafts, model_probs = self._draft.propose(
                [items[i] for i in to_model], [states[i] for i in to_model]
            )
            for i, tokens, p in zip(to_model, model_drafts, model_probs):
                drafts[i], probs[i] = tokens, p
                request = states[i].request
                self._pending[request.request_id] = (
                    self.model,
                    len(tokens),
                    request.num_accepted_tokens,
                )
        return drafts, probs

    def _short_match_wins(self) -> bool:
        self._decisions += 1
        wins = self.short_ngram.rate > self.model.rate
        return not wins if self._decisions % self.explore_every == 0 else wins

    def on_verified(self, requests) -> None:
        for request in requests:
            estimate, num_drafts, accepted_before = self._pending.pop(
                request.request_id, (None, 0, 0)
            )
            if estimate is not None:
                estimate.record(num_drafts, request.num_accepted_tokens - accepted_before)
        self._draft.on_verified(requests)

    def free(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._decided.pop(request_id, None)
        self._ngram.forget(request_id)
        self._draft.free(request_id)

    def pool_stats(self):
        return self._draft.pool_stats()

    def update_cost(self, batch_size: int, target_cost) -> float:
        """The draft model's measured cost (n-gram lookup's is fixed and tiny)."""
        self.draft_cost = self._draft.update_cost(batch_size, target_cost)
        return self.draft_cost

    @property
    def max_catchup(self) -> int:
        return self._draft.max_catchup

    def on_target_forward(self, items, seqs) -> None:
        hook = getattr(self._draft, "on_target_forward", None)
        if hook is not None:  # an EAGLE draft reads every target forward's features
            hook(items, seqs)


def build_proposer(method: str, config: EngineConfig, target_loaded, draft_loaded, num_blocks: int):
    if method == "none":
        return None
    if method == "ngram":
        return NgramSpecProposer(config.ngram_min, config.ngram_max)
    if method == "suffix":
        from engine.spec_decode.tree_proposer import SuffixSpecProposer

        return SuffixSpecProposer(config.spec_tree_max_nodes, config.suffix_cache_mib)
    if method == "ngram-tree":
        from engine.spec_decode.tree_proposer import NgramTreeSpecProposer

        return NgramTreeSpecProposer(config.spec_tree_max_nodes, config.ngram_min, config.ngram_max)
    from engine.spec_decode.draft_model import DraftModelProposer
    from engine.spec_decode.eagle import EagleDraftForCausalLM
    from engine.spec_decode.eagle_proposer import EagleProposer

    if method in ("eagle", "eagle-tree") and not isinstance(
        draft_loaded.model, EagleDraftForCausalLM
    ):
        raise ValueError(
            f"speculative_method {method!r} needs an EAGLE draft (specserve train-draft "
            f"--method eagle); {draft_loaded.name} is a draft model"
        )
    if method == "eagle-tree":
        from engine.spec_decode.eagle_tree import EagleTreeProposer

        return EagleTreeProposer(config, draft_loaded, target_loaded, num_blocks)
    if isinstance(draft_loaded.model, EagleDraftForCausalLM):
        draft = EagleProposer(config, draft_loaded, target_loaded, num_blocks)
    else:
        draft = DraftModelProposer(config, draft_loaded, target_loaded, num_blocks)
    if method == "hybrid":
        return HybridProposer(NgramProposer(config.ngram_min, config.ngram_max), draft)
    return draft
