"""A request's drafts as verification sees them: a chain or a token tree.

A request verifies ``[last, n_0 .. n_{N-1}]``: row 0 samples the token after the last
verified one, row ``1 + i`` the token after draft node ``i``. A chain's node ``i``
follows node ``i - 1``; a tree's follows ``parents[i]`` (-1: the root, the last
verified token), in topological order (a parent before its children)::

    chain  last -> d0 -> d1 -> d2          parents None (or [-1, 0, 1])
    tree   last -> a -> b                  parents [-1, 0, -1, 2, 2]
               \\-> c -> d
                       \\-> e

Row ``1 + i`` is adjusted, masked and sampled as plain decoding would sample the
position after node ``i``'s path (its ancestors and itself): position ``last + depth``.
Verification walks from the root: at each row the target's sample picks the child
holding that token, and the walk ends at a row with no such child (that sample is the
recovered or bonus token). So each output token is the target's own sample at its
position, whatever the tree: coupling makes any tree exact (engine/spec_decode/verifier.py).
"""

from __future__ import annotations


def depths(parents: list[int] | None, num_nodes: int) -> list[int]:
    """Each node's depth below the root (a child of the root is 1)."""
    if parents is None:
        return list(range(1, num_nodes + 1))
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def node_path(parents: list[int] | None, node: int) -> list[int]:
    """The nodes from the root's child down to ``node`` (inclusive)."""
    if parents is None:
        return list(range(node + 1))
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def row_prefixes(tokens: list[int], parents: list[int] | None) -> list[list[int]]:
    """For each of the ``1 + len(tokens)`` rows, the draft tokens before the position it
    samples: none for row 0, node ``i``'s path for row ``1 + i``."""
    if parents is None:
        return [tokens[:j] for j in range(len(tokens) + 1)]
    prefixes: list[list[int]] = [[]]
    for i, parent in enumerate(parents):
        prefixes.append(prefixes[parent + 1] + [tokens[i]])
    return prefixes


def walk(
    tokens: list[int], parents: list[int] | None, samples: list[int]
) -> tuple[list[int], list[int]]:
    """Verification by coupling: ``samples[r]`` is the target's sample at row ``r``.
    Returns (the output tokens: the accepted nodes' tokens and then one sample, the
    accepted node indices, root's child first)."""
    if parents is None:
        n = 0
        while n < len(tokens) and tokens[n] == samples[n]:
            n += 1
        return tokens[:n] + [samples[n]], list(range(n))
    children: dict[tuple[int, int], int] = {
        (parent, token): i for i, (parent, token) in enumerate(zip(parents, tokens))
    }
    row, accepted = 0, []
    while (node := children.get((row - 1, samples[row]))) is not None:
        accepted.append(node)
        row = node + 1
    return [tokens[i] for i in accepted] + [samples[row]], accepted


def children(parents: list[int]) -> list[list[int]]:
    """Per row (0: the root, ``1 + i``: node ``i``), the nodes below it, in order."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        out[parent + 1].append(node)
    return out


def accepted_rows(accepted: list[int]) -> list[int]:
    """The rows the output tokens were sampled at: the root's and the accepted nodes'."""
    return [0] + [node + 1 for node in accepted]


def ancestor_masks(parents: list[int] | None, num_verified: int, num_nodes: int) -> list[int]:
    """Attention masks of the fed tokens ``[v_0 .. v_{m-1}, n_0 .. n_{N-1}]`` (``m`` verified
    tokens, the last of them the root): bit ``b`` of token ``j``'s mask is set when it
    sees fed token ``b``. Verified tokens see each other causally; a node sees them and
    its ancestors and itself."""
    masks = [(1 << (j + 1)) - 1 for j in range(num_verified)]
    root = masks[-1] if masks else 0
    for i in range(num_nodes):
        parent = i - 1 if parents is None else parents[i]
        above = root if parent < 0 else masks[num_verified + parent]
        masks.append(above | (1 << (num_verified + i)))
    return masks


def keep_nodes(
    tokens: list[int], parents: list[int], keep: list[bool]
) -> tuple[list[int], list[int] | None]:
    """The tree of the kept nodes (a kept node's parent must be kept), re-indexed in the
    same order; parents None when what is left is a chain."""
    index: dict[int, int] = {-1: -1}
    out_tokens, out_parents = [], []
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        if keep[i]:
            if parent not in index:
                raise ValueError(f"node {i} is kept but its parent {parent} is not")
            index[i] = len(out_tokens)
            out_tokens.append(token)
            out_parents.append(index[parent])
    return out_tokens, (None if is_chain(out_parents) else out_parents)


def is_chain(parents: list[int] | None) -> bool:
    return parents is None or all(p == i - 1 for i, p in enumerate(parents))


def check_tree(tokens: list[int], parents: list[int]) -> None:
    """ValueError unless ``parents`` is a topological tree over ``tokens`` with distinct
    tokens among siblings."""
    if len(parents) != len(tokens):
        raise ValueError(f"parents has {len(parents)} entries for {len(tokens)} draft tokens")
    seen = set()
    for i, (parent, token) in enumerate(zip(parents, tokens)):
        if not -1 <= parent < i:
            raise ValueError(f"parents[{i}] must be in [-1, {i - 1}], got {parent}")
        if (parent, token) in seen:
            raise ValueError(f"draft node {i} repeats a sibling's token {token}")
        seen.add((parent, token))
