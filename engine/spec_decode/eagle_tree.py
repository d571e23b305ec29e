"""EAGLE with a dynamic token tree (``--speculative-method eagle-tree``).

A chain of drafts is lost at its first miss; the shipped EAGLE draft agrees with the
target's next token about 40% of the time, so a chain keeps about 1.5 tokens a
verification. A dynamic tree (EAGLE-2's idea) spends the same verification on the
draft's several best guesses where it is unsure:

1. The burst's first forward catches the draft up on the verified tokens (the
   target's features, as ``EagleProposer``), and its last row's distribution gives the
   root's ``TOP_K`` most likely children, each scored by its draft probability.
2. Each further depth expands the ``TOP_K`` best-scoring nodes of the depth before
   (a node's score: the product of the draft's probabilities down its path, the draft's
   own estimate of the chance that the path is the target's), while their scores,
   calibrated, promise more tokens than the draft forward costs (``draft_cost``, in
   plain decode steps, measured): one forward feeds every
   node expanded so far with a tree mask (each sees the context and its ancestors, at
   position context + depth - 1; re-feeding the earlier depths, which the one-layer
   draft does for almost nothing, keeps the kernels' rule that a step's tokens see the
   context before the step in full), each reading its parent's output as its hidden
   input, and each new frontier node's children join the candidates.
3. The candidates form one ``DraftTree``; ``price_tree`` keeps its best nodes for the
   slots the scheduler granted, pricing each node at the measured cost of one more
   verified token against its score times a calibration (tokens kept per token the
   scores predicted, decayed), as suffix decoding's trees are priced.

Verification couples trees (no q is needed: a node is kept when it is the target's
own sample there), so the output is exactly what plain decoding gives, whatever the
draft proposes. After verification the target's features of the accepted path are
moved to the positions they now hold (``EagleProposer.on_accepted_nodes``), as the
engine moves their KV.
"""

from __future__ import annotations

import time

import torch

from engine.core.model_runner import SeqInput
from engine.spec_decode.draft_tree import DraftTree
from engine.spec_decode.eagle_proposer import EagleProposer
from engine.spec_decode.tree_proposer import price_tree

TOP_K = 4  # children per expanded node, and nodes expanded per depth
MAX_DEPTH = 6
# The calibration's prior (as if one token had been predicted and half of one kept: a
# weak prior, since a draft's probabilities may be off by a large factor either way,
# and a few verified trees should outweigh it) and decay.
_PRIOR_PREDICTED = 1.0
_PRIOR_KEPT = 0.5
_DECAY = 0.98
LANE = "eagle-tree"


class _Node:
    __slots__ = ("token", "parent", "score", "depth", "out", "fed")

    def __init__(self, token: int, parent: int, score: float, depth: int) -> None:
        self.token, self.parent, self.score, self.depth = token, parent, score, depth
        self.out: torch.Tensor | None = None  # the draft's output at this node, once fed
        self.fed = -1  # its index among the tokens a depth's forward feeds


class EagleTreeProposer(EagleProposer):
    tree_sources = (LANE,)

    def __init__(self, config, draft_loaded, target_loaded, num_blocks: int) -> None:
        super().__init__(config, draft_loaded, target_loaded, num_blocks)
        self.max_nodes = config.spec_tree_max_nodes
        self.predicted, self.kept = _PRIOR_PREDICTED, _PRIOR_KEPT
        # request id -> (predicted accepted tokens, accepted before)
        self._pending: dict[str, tuple[float, int]] = {}

    @property
    def calibration(self) -> float:
        return self.kept / self.predicted

    def source_for(self, request, max_k: int = 0) -> tuple[str, float]:
        return LANE, self.draft_cost

    # ---- the tree -------------------------------------------------------------------
    def propose(self, items, states):
        trees: list = [[] for _ in items]
        # slots for the deepest forward: every expanded node, re-fed
        active, logits, out = self._catch_up(
            items, states, lambda nodes: TOP_K * (min(MAX_DEPTH, nodes) - 1) + 1
        )
        if logits is not None:
            grown = self._grow(active, logits, out, states)
            for (i, _, nodes), tree in zip(active, grown):
                trees[i] = self._priced(items[i], states[i].request, tree, nodes)
        return trees, None

    def _grow(self, active, logits, out, states) -> list[DraftTree]:
        """Each active request's candidate tree, from the first forward's rows."""
        trees: list[list[_Node]] = []
        roots: list[torch.Tensor] = []  # the draft's output at each root
        frontiers: list[list[int]] = []
        depths = [min(MAX_DEPTH, nodes) for _, _, nodes in active]
        started = time.perf_counter()
        top_ids, top_probs = self._top(logits)
        for row, (i, _, _) in enumerate(active):
            stops = states[i].request.stop_token_ids
            tree = [_Node(t, -1, p, 1) for t, p in zip(top_ids[row], top_probs[row])]
            roots.append(out[row])  # a depth-1 node's hidden input
            trees.append(tree)
            frontiers.append([n for n, node in enumerate(tree) if node.token not in stops])
        for depth in range(2, max(depths, default=0) + 1):
            # A depth costs a draft forward (shared by the requests that grow); its
            # nodes can add at most what their parents' scores promise. A request
            # stops growing where that no longer pays: a draft unsure of its guesses
            # gets a shallow, wide tree, a sure one a deep tree.
            growing = [
                r
                for r in range(len(active))
                if depth <= depths[r]
                and frontiers[r]
                and self.calibration * sum(trees[r][n].score for n in frontiers[r])
                > self.draft_cost / len(active)
            ]
            if not growing:
                break
            seqs, inputs = [], []
            for r in growing:
                seq, hidden = self._depth_input(active[r][1], trees[r], frontiers[r], roots[r])
                seqs.append(seq)
                inputs.append(hidden)
            logits, out = self._forward(seqs, inputs)
            top_ids, top_probs = self._top(logits)
            row = 0
            for r in growing:
                tree, stops = trees[r], states[active[r][0]].request.stop_token_ids
                candidates = []
                for parent in frontiers[r]:
                    node = tree[parent]
                    node.out = out[row]
                    for token, p in zip(top_ids[row], top_probs[row]):
                        candidates.append(len(tree))
                        tree.append(_Node(token, parent, node.score * p, depth))
                    row += 1
                best = sorted(candidates, key=lambda n: -tree[n].score)[:TOP_K]
                frontiers[r] = sorted(n for n in best if tree[n].token not in stops)
            now = time.perf_counter()
            self.cost_meter.observe(len(growing), now - started)
            started = now
        return [
            DraftTree([n.token for n in tree], [n.parent for n in tree], [n.score for n in tree])
            for tree in trees
        ]

    def _top(self, logits: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
        """Per row of ``logits`` [rows, draft vocab]: the TOP_K most likely next tokens
        under the draft and their probabilities (one softmax and top-k for all rows)."""
        top = torch.topk(torch.softmax(logits.float(), dim=-1), TOP_K, dim=-1)
        ids = top.indices if self.vocab is None else self.vocab[top.indices]
        return ids.tolist(), top.values.tolist()

    def _depth_input(self, ereq, tree: list[_Node], frontier: list[int], root: torch.Tensor):
        """One request's input to a depth's forward: every node expanded before this
        depth and the frontier, in that order (the frontier last: its rows are the
        logits), each at position context + depth - 1, seeing its ancestors."""
        expanded = [n for n, node in enumerate(tree) if node.fed >= 0 and n not in frontier]
        fed = expanded + frontier
        masks: list[int] = []
        for b, n in enumerate(fed):
            tree[n].fed = b
            parent = tree[n].parent
            above = masks[tree[parent].fed] if parent >= 0 else 0
            masks.append(above | (1 << b))
        start = ereq.num_tokens  # the context: every verified token but none of the tree
        positions = [start - 1 + tree[n].depth for n in fed]
        parents = [tree[n].parent for n in fed]
        hidden = torch.stack([root if p < 0 else tree[p].out for p in parents])
        seq = SeqInput(
            [tree[n].token for n in fed],
            start,
            self.kv.get_block_ids(ereq.request_id),
            len(frontier),
        )
        seq.positions, seq.tree_mask = positions, masks
        return seq, hidden

    def _priced(self, item, request, tree: DraftTree, nodes: int):
        if not tree.tokens:
            return []
        if item.spec_source == LANE:  # adaptive: the nodes that pay for their slot
            # (the draft is paid already: a node costs its verification alone). Adaptive
            # k granted the slots from the request's measured acceptance, so the best
            # node goes in even where no node's score pays: the calibration learns only
            # from trees that are verified (a draft that is right more often than its
            # probabilities say would otherwise never be tried).
            verify_cost = max(item.spec_token_cost - self.draft_cost, 1e-3)
            tree = price_tree(tree, self.calibration, verify_cost, nodes) or tree.prune(1)
        else:  # a request's fixed k: its k best nodes
            tree = tree.prune(nodes)
        if tree is None or not tree.tokens:
            return []
        self._pending[request.request_id] = (sum(tree.scores), request.num_accepted_tokens)
        return tree

    # ---- after verification ---------------------------------------------------------
    def on_verified(self, requests) -> None:
        for request in requests:
            pending = self._pending.pop(request.request_id, None)
            if pending is not None:
                predicted, accepted_before = pending
                self.predicted = _DECAY * self.predicted + predicted
                self.kept = _DECAY * self.kept + request.num_accepted_tokens - accepted_before
        super().on_verified(requests)

    def free(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        super().free(request_id)
