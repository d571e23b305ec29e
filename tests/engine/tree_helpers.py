"""An adversarial token-tree proposer for tests: random trees around n-gram lookup's
continuation, so verification meets every shape (wide, deep, the right path on a late
branch, siblings that share prefixes with the right one, single nodes) and still
accepts often enough to move KV around."""

from __future__ import annotations

import random

from engine.spec_decode.draft_tree import DraftTree
from engine.spec_decode.proposers import NgramSpecProposer


class RandomTreeProposer(NgramSpecProposer):
    """Trees of up to ``num_spec_tokens`` nodes: n-gram lookup's continuation placed at
    a random sibling position, the rest random tokens of ``vocab`` in random shapes
    (the n-gram proposer's bookkeeping, its own proposals)."""

    tree_sources = ("tree",)

    def __init__(self, seed: int, vocab: range = range(3, 200)) -> None:
        super().__init__(1, 4)
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.num_trees = 0

    def source_for(self, request, max_k: int = 0):
        return "tree", self.draft_cost

    def propose(self, items, states):
        out = []
        for item, state in zip(items, states):
            tokens = state.request.all_token_ids
            budget = item.num_spec_tokens
            guess, _ = self._ngram.propose_for(state.request.request_id, tokens, budget)
            out.append(self._tree(guess, budget))
        return out, None

    def _tree(self, guess: list[int], budget: int):
        rng = self.rng
        if budget <= 0:
            return []
        if rng.random() < 0.15:  # a plain chain now and then
            return guess[:budget]
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[int, set[int]] = {}

        def add(parent: int, token: int) -> int | None:
            if len(tokens) >= budget or token in children.setdefault(parent, set()):
                return None
            children[parent].add(token)
            tokens.append(token)
            parents.append(parent)
            return len(tokens) - 1

        # random siblings at the root first, so the guessed path is not always node 0
        for _ in range(rng.randint(0, 2)):
            add(-1, rng.choice(self.vocab))
        parent = -1
        for token in guess:
            node = add(parent, token)
            if node is None:
                break
            for _ in range(rng.randint(0, 1)):  # a wrong sibling beside the path
                add(parent, rng.choice(self.vocab))
            parent = node
        while len(tokens) < budget and rng.random() < 0.7:
            add(rng.randrange(-1, len(tokens)), rng.choice(self.vocab))
        if not tokens:
            return []
        self.num_trees += 1
        return DraftTree(tokens, parents, [0.5] * len(tokens))


def install_tree_proposer(engine, seed: int) -> RandomTreeProposer:
    """Swap ``engine``'s proposer (an n-gram engine's) for random trees."""
    proposer = RandomTreeProposer(seed)
    engine.proposer = proposer
    engine.scheduler.tree_sources = frozenset(proposer.tree_sources)
    engine.scheduler.spec_source = lambda request: proposer.source_for(request)
    return proposer
