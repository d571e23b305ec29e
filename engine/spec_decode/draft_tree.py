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

    def prune(self, max_nodes: int) -> DraftTree:
        """The ``max_nodes`` best-scored nodes, every kept node's parent kept (ties: the
        shallower first), in the same order."""
        if len(self.tokens) <= max_nodes:
            return self
        depth = paths.depths(self.parents, len(self.tokens))
        order = sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], depth[i], i))
        keep = [False] * len(self.tokens)
        kept = 0
        for i in order:
            if kept == max_nodes:
                break
            parent = self.parents[i]
            if parent < 0 or keep[parent]:
                keep[i] = True
                kept += 1
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
