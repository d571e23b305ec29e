"""Token trees from suffix decoding, priced per request and per step.

``SuffixSpecProposer`` (``--speculative-method suffix``) proposes, for each speculating
request, a tree of candidate continuations from suffix decoding
(engine/spec_decode/suffix.py): what followed the longest match of the request's
latest tokens in its own prompt and output, and in the recent answers of the same
caller (one cache per API key: how fast a guess is accepted could otherwise reveal
another tenant's text). Each node comes with a score, the estimated chance that
verification reaches and keeps it, so the tree's expected accepted length is the sum
of its scores (coupling keeps exactly one path, and a node is kept with the chance of
its path).

Pricing: the scheduler grants a tree lane's request up to ``spec_tree_max_nodes``
slots and the price of one more verified token, in plain decode steps of this batch
(``ScheduledRequest.spec_token_cost``: the step-cost model's measured slope, plus the
lookup). ``price_tree`` keeps the ``n`` best nodes that maximise

    (1 + calibration * sum of their scores) / (1 + cost * n),

tokens per step over the step's cost relative to plain decoding: a node pays when its
score beats the step's marginal cost. ``calibration`` is the measured ratio of tokens
kept to tokens the scores predicted, decayed, so overconfident frequencies shrink the
trees they size.
"""

from __future__ import annotations

from engine.spec_decode.draft_tree import DraftTree
from engine.spec_decode.suffix import SuffixDecoder

MiB = 1 << 20
# The calibration's prior (as if 8 tokens had been predicted and 4 kept) and decay.
_PRIOR_PREDICTED = 8.0
_PRIOR_KEPT = 4.0
_DECAY = 0.98


def price_tree(
    tree: DraftTree, calibration: float, token_cost: float, max_nodes: int
) -> DraftTree | None:
    """The best-paying top of ``tree`` (at most ``max_nodes`` nodes), or None when no
    node pays. Nodes are taken best score first (a parent before its children: scores
    never grow down a path), skipping any whose parent was not taken."""
    n = len(tree.tokens)
    if n == 0 or max_nodes <= 0:
        return None
    ranked = tree.ranked(max_nodes)
    best_n, best_value, gain = 0, 1.0, 1.0
    for count, i in enumerate(ranked, 1):
        gain += calibration * tree.scores[i]
        value = gain / (1.0 + token_cost * count)
        if value > best_value:
            best_n, best_value = count, value
    if best_n == 0:
        return None
    keep = [False] * n
    for i in ranked[:best_n]:
        keep[i] = True
    return tree.subtree(keep)


# A match of this many tokens or more is the "suffix" lane, a shorter one
# "suffix-short": each keeps its own acceptance history per request and its own lane
# in the speculation gate, which closes the short matches where they do not pay (open
# chat at temperature 0.7) without holding back the long ones.
LONG_MATCH = 3


class SuffixSpecProposer:
    """Deterministic token trees (q is one-hot: verification couples them).

    ``source_for`` (asked by the scheduler before it grants slots) proposes the tree
    with the most nodes a step may take and names its lane by the match length;
    ``propose`` prices that tree for the slots granted."""

    draft_cost = 0.01  # an index walk on the host; verification is priced by the scheduler
    tree_sources = ("suffix", "suffix-short")

    def __init__(self, max_nodes: int, cache_mib: float) -> None:
        self.max_nodes = max_nodes
        self._suffix = SuffixDecoder(max_cache_bytes=int(cache_mib * MiB))
        self.predicted = _PRIOR_PREDICTED
        self.kept = _PRIOR_KEPT
        # request id -> (the request, predicted accepted tokens, accepted before)
        self._pending: dict[str, tuple[object, float, int]] = {}
        # request id -> (its token count when proposed, the tree, the lane)
        self._proposed: dict[str, tuple[int, DraftTree, str]] = {}
        self._requests: dict[str, object] = {}  # the requests proposed for, until freed

    @property
    def calibration(self) -> float:
        """Tokens kept per token the scores predicted, decayed."""
        return self.kept / self.predicted

    def source_for(self, request, max_k: int = 0) -> tuple[str, float]:
        """(the lane of the request's tree this step, the cost of a draft)."""
        return self._tree_for(request)[2], self.draft_cost

    def _tree_for(self, request) -> tuple[int, DraftTree, str]:
        proposed = self._proposed.get(request.request_id)
        if proposed is None or proposed[0] != request.num_tokens:
            budget = self.max_nodes
            tree = self._suffix.propose(
                request.request_id,
                request.all_token_ids,
                request.cache_scope,
                max_nodes=budget,
                max_depth=budget,
            )
            long = self._suffix.last_match_length >= LONG_MATCH
            proposed = (request.num_tokens, tree, "suffix" if long else "suffix-short")
            self._proposed[request.request_id] = proposed
        return proposed

    def propose(self, items, states):
        trees: list[DraftTree | list[int]] = []
        calibration = self.calibration
        for item, state in zip(items, states):
            request = state.request
            self._requests[request.request_id] = request
            budget = item.num_spec_tokens
            tree = self._tree_for(request)[1]
            if item.spec_source in self.tree_sources:  # adaptive: priced
                tree = price_tree(tree, calibration, item.spec_token_cost, budget)
            else:  # a request's fixed k: its k best nodes
                tree = tree.prune(budget)
            if tree is None or not tree.tokens:
                trees.append([])
                continue
            self._pending[request.request_id] = (
                request,
                sum(tree.scores),
                request.num_accepted_tokens,
            )
            trees.append(tree)
        return trees, None

    def on_verified(self, requests) -> None:
        for request in requests:
            pending = self._pending.pop(request.request_id, None)
            if pending is None:
                continue
            _, predicted, accepted_before = pending
            self.predicted = _DECAY * self.predicted + predicted
            self.kept = _DECAY * self.kept + request.num_accepted_tokens - accepted_before

    def free(self, request_id: str) -> None:
        """A finished request's text joins its caller's cache of recent answers; a
        preempted one's index is dropped (rebuilt when it speculates again)."""
        self._pending.pop(request_id, None)
        self._proposed.pop(request_id, None)
        request = self._requests.pop(request_id, None)
        if request is not None and request.is_finished and request.num_output_tokens:
            self._suffix.add_finished(
                request.all_token_ids, request.cache_scope, request.num_prompt_tokens
            )
        self._suffix.forget(request_id)

    def pool_stats(self):
        return None


class NgramTreeSpecProposer(SuffixSpecProposer):
    """``--speculative-method ngram-tree``: n-gram lookup whose last few matches are the
    branches of a token tree (``NgramProposer.propose_tree_for``: what followed each of
    the last 4 occurrences of the longest n-gram ending the context, merged, each node
    scored by the share of occurrences through it), priced and calibrated as suffix
    decoding's trees are. The request's own text only: no cache of other answers."""

    tree_sources = ("ngram", "ngram-short")

    def __init__(self, max_nodes: int, ngram_min: int, ngram_max: int) -> None:
        super().__init__(max_nodes, cache_mib=0.0)
        from engine.spec_decode.ngram import NgramProposer

        self._ngram = NgramProposer(ngram_min, ngram_max)

    def _tree_for(self, request) -> tuple[int, DraftTree, str]:
        proposed = self._proposed.get(request.request_id)
        if proposed is None or proposed[0] != request.num_tokens:
            budget = self.max_nodes
            tree = self._ngram.propose_tree_for(
                request.request_id, request.all_token_ids, budget, budget
            )
            long = self._ngram.last_match_length >= LONG_MATCH
            proposed = (request.num_tokens, tree, "ngram" if long else "ngram-short")
            self._proposed[request.request_id] = proposed
        return proposed

    def free(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._proposed.pop(request_id, None)
        self._requests.pop(request_id, None)
        self._ngram.forget(request_id)
