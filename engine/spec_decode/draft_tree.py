"""A proposer's token tree: candidate continuations of a request, verified in one pass.

``tokens[i]`` follows ``parents[i]`` (-1: the request's last verified token, the root),
in topological order (a parent before its children), siblings holding distinct tokens
(engine/spec_decode/paths.py has the verification side). ``scores[i]`` is the
proposer's estimate of the chance that verification keeps node ``i`` (reaches it and
takes it): the product of its conditional estimates down the path, so it never grows
from a parent to a child, and the sum of all scores is the expected number of accepted
tokens.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.spec_decode import paths


@dataclass(slots=True)
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)

    @classmethod
    def chain(cls, tokens: list[int], scores: list[float] | None = None) -> DraftTree:
        return cls(
            list(tokens),
            list(range(-1, len(tokens) - 1)),
            list(scores) if scores is not None else [1.0] * len(tokens),
        )

    @classmethod
    def from_continuations(
        cls,
        continuations: Iterable[tuple[Sequence[int], float]],
        max_nodes: int,
        pseudo_count: float = 0.0,
    ) -> DraftTree:
        """Weighted continuations of the root merged into one tree, its ``max_nodes``
        best nodes taken best first.

        Continuations that share a prefix share its path and part where they diverge
        (siblings). A node's weight is the total weight of the continuations through it
        (the root's: of all of them) and its score the product down its path of
        ``weight(node) / (weight(parent) + pseudo_count)``: the frequency with which
        what followed before took this branch, shrunk by a pseudo-count so that few
        or weak occurrences never promise certainty. Scores fall down every path, so
        best first is also parent first. Ties go to the branch inserted first."""
        trie = _Trie()
        for tokens, weight in continuations:
            trie.add(tokens, weight)
        return trie.best_first(max_nodes, pseudo_count)

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def depth(self) -> int:
        """The longest path's length (0 for an empty tree)."""
        return max(paths.depths(self.parents, len(self.tokens)), default=0)

    def validate(self) -> None:
        """ValueError unless the tree is well formed (paths.check_tree), one score per
        node, each in [0, 1] and no more than its parent's."""
        paths.check_tree(self.tokens, self.parents)
        if len(self.scores) != len(self.tokens):
            raise ValueError(f"{len(self.scores)} scores for {len(self.tokens)} nodes")
        for i, (score, parent) in enumerate(zip(self.scores, self.parents)):
            if not 0.0 <= score <= 1.0:
                raise ValueError(f"scores[{i}] must be in [0, 1], got {score}")
            if parent >= 0 and score > self.scores[parent] + 1e-9:
                raise ValueError(
                    f"scores[{i}] = {score} exceeds its parent's {self.scores[parent]}"
                )

    def ranked(self, max_nodes: int) -> list[int]:
        """Up to ``max_nodes`` nodes, best score first (ties: the shallower first), each
        after its parent: a node whose parent is not among them is skipped."""
        depth = paths.depths(self.parents, len(self.tokens))
        order = sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], depth[i], i))
        taken = [False] * len(self.tokens)
        out: list[int] = []
        for i in order:
            if len(out) == max_nodes:
                break
            parent = self.parents[i]
            if parent < 0 or taken[parent]:
                taken[i] = True
                out.append(i)
        return out

    def prune(self, max_nodes: int) -> DraftTree:
        """The ``max_nodes`` best-scored nodes (``ranked``), in the same order."""
        if len(self.tokens) <= max_nodes:
            return self
        keep = [False] * len(self.tokens)
        for i in self.ranked(max_nodes):
            keep[i] = True
        return self.subtree(keep)

    def subtree(self, keep: list[bool]) -> DraftTree:
        """The kept nodes (each kept node's parent kept), re-indexed in order."""
        index: dict[int, int] = {-1: -1}
        out = DraftTree()
        for i, flag in enumerate(keep):
            if flag:
                index[i] = len(out.tokens)
                out.tokens.append(self.tokens[i])
                out.parents.append(index[self.parents[i]])
                out.scores.append(self.scores[i])
        return out


class _Trie:
    """Continuations merged: node 0 is the root; ``weights[node]`` the total weight of
    the continuations through it."""

    __slots__ = ("child", "kids", "weights", "tokens", "parents")

    def __init__(self) -> None:
        self.child: dict[tuple[int, int], int] = {}  # (node, token) -> child
        self.kids: list[list[int]] = [[]]  # node -> children, in insertion order
        self.weights = [0.0]
        self.tokens = [-1]
        self.parents = [-1]

    def add(self, continuation: Sequence[int], weight: float) -> None:
        node = 0
        self.weights[0] += weight
        for token in continuation:
            next_node = self.child.get((node, token))
            if next_node is None:
                next_node = self.child[(node, token)] = len(self.weights)
                self.kids[node].append(next_node)
                self.kids.append([])
                self.weights.append(0.0)
                self.tokens.append(token)
                self.parents.append(node)
            self.weights[next_node] += weight
            node = next_node

    def best_first(self, max_nodes: int, pseudo_count: float) -> DraftTree:
        tree = DraftTree()
        index = {0: -1}  # trie node -> tree node
        scores = [1.0] * len(self.weights)
        heap: list[tuple[float, int]] = []
        node = 0
        while True:
            scale = scores[node] / (self.weights[node] + pseudo_count)
            for kid in self.kids[node]:
                scores[kid] = min(1.0, scale * self.weights[kid])
                heapq.heappush(heap, (-scores[kid], kid))
            if not heap or len(tree.tokens) >= max_nodes:
                return tree
            _, node = heapq.heappop(heap)
            index[node] = len(tree.tokens)
            tree.tokens.append(self.tokens[node])
            tree.parents.append(index[self.parents[node]])
            tree.scores.append(scores[node])
