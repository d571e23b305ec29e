"""Prompt lookup: propose what followed the most recent earlier occurrence of the last
n tokens (n from ngram_max down to ngram_min). No weights at all.

Two equivalent ways to find it: ``propose_with_match`` scans the whole sequence (numpy,
stateless: the reference), ``propose_for`` keeps per request an index of where every
n-gram last started and extends it with the tokens verified since its last call, so a
step's lookup costs a few dict reads instead of a scan of the context (~0.3 ms a
request at a few hundred tokens, 3% of a decode step of the default model).

``propose_tree_for`` proposes a token tree instead (engine/spec_decode/draft_tree.py):
the continuations of the last few occurrences of the longest matching n-gram, merged
where they agree and branching where they differ. Its index (``_OccurrenceIndex``) is
kept apart, so ``propose_for`` and its index stay as they are.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.spec_decode.draft_tree import DraftTree

# Requests whose index is kept; the least recently used beyond this is rebuilt from
# scratch if it proposes again (a dict build, ~1 ms per 2,000 tokens).
MAX_INDEXED_REQUESTS = 64
# Token trees: a single occurrence of an n-gram continues it with conditional
# probability 1 / (1 + TREE_PSEUDO_COUNT / n), so a longer match is trusted more and no
# guess is ever certain. 4 makes the scores honest on code (scripts/bench_suffix.py:
# tokens kept / sum of scores 1.09; 0.38 with 1).
TREE_PSEUDO_COUNT = 4.0


class _Index:
    """For one growing token list: per n, n-gram -> the start of its latest occurrence
    among the windows that end before the last token (a window must have a
    continuation); windows starting below ``next_start[n]`` are in."""

    __slots__ = ("tokens", "length", "last", "next_start")

    def __init__(self, tokens: list[int], ngram_min: int, ngram_max: int) -> None:
        self.tokens = tokens  # the request's own list: a different list is a new request
        self.length = 0
        self.last: dict[int, dict] = {n: {} for n in range(ngram_min, ngram_max + 1)}
        self.next_start = dict.fromkeys(self.last, 0)

    def extend(self) -> None:
        tokens = self.tokens
        end = len(tokens)
        for n, table in self.last.items():
            first, stop = self.next_start[n], end - n  # starts first .. stop - 1
            if stop <= first:
                continue
            keys = _windows(tokens, first, stop, n)
            table.update(zip(keys, range(first, stop)))  # later starts overwrite
            self.next_start[n] = stop
        self.length = end


def _windows(tokens: list[int], first: int, stop: int, n: int):
    """The n-grams of ``tokens`` starting at first .. stop - 1, in order: a token itself
    for n = 1, else a tuple."""
    if n == 1:
        return tokens[first:stop]
    return zip(*(tokens[first + i : stop + i] for i in range(n)))


class _OccurrenceIndex:
    """For one growing token list: per n, n-gram -> the start of its latest occurrence
    (as ``_Index``), and ``previous[n][start]``, the start of the occurrence before the
    one at ``start`` (-1: none). Every occurrence is reachable, newest first, at one
    list read per step back, for one extra list entry per token and n."""

    __slots__ = ("tokens", "length", "last", "previous")

    def __init__(self, tokens: list[int], ngram_min: int, ngram_max: int) -> None:
        self.tokens = tokens
        self.length = 0
        self.last: dict[int, dict] = {n: {} for n in range(ngram_min, ngram_max + 1)}
        self.previous: dict[int, list[int]] = {n: [] for n in self.last}

    def extend(self) -> None:
        tokens = self.tokens
        end = len(tokens)
        for n, table in self.last.items():
            previous = self.previous[n]
            first, stop = len(previous), end - n  # windows with a continuation only
            if stop <= first:
                continue
            keys = _windows(tokens, first, stop, n)
            get = table.get
            for start, key in enumerate(keys, first):
                previous.append(get(key, -1))
                table[key] = start
        self.length = end

    def starts(self, n: int, key, limit: int) -> list[int]:
        """Up to ``limit`` starts of ``key`` (an n-gram), the most recent first."""
        out: list[int] = []
        start = self.last[n].get(key, -1)
        while start >= 0 and len(out) < limit:
            out.append(start)
            start = self.previous[n][start]
        return out


class NgramProposer:
    def __init__(self, ngram_min: int = 1, ngram_max: int = 4) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.last_match_length = 0  # of the last propose_tree_for
        self._indexes: OrderedDict[str, _Index] = OrderedDict()
        self._tree_indexes: OrderedDict[str, _OccurrenceIndex] = OrderedDict()

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k draft tokens continuing ``token_ids`` (empty when nothing matches)."""
        return self.propose_with_match(token_ids, k)[0]

    def propose_with_match(self, token_ids: list[int], k: int) -> tuple[list[int], int]:
        """(up to k draft tokens, length of the matched suffix; 0 when nothing matches)."""
        if k <= 0 or len(token_ids) < self.ngram_min + 1:
            return [], 0
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            # Windows that start before the suffix itself: tokens[j : j + n], j < L - n.
            windows = sliding_window_view(tokens[:-1], n)  # [L - n, n]
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent occurrence
                return token_ids[start : start + k], n
        return [], 0

    def propose_for(self, request_id: str, token_ids: list[int], k: int) -> tuple[list[int], int]:
        """``propose_with_match`` for a request whose ``token_ids`` (the same list from
        call to call) only grow, from its kept index."""
        if k <= 0 or len(token_ids) < self.ngram_min + 1:
            return [], 0
        index = self._indexes.get(request_id)
        if index is None or index.tokens is not token_ids or len(token_ids) < index.length:
            index = self._indexes[request_id] = _Index(token_ids, self.ngram_min, self.ngram_max)
            if len(self._indexes) > MAX_INDEXED_REQUESTS:
                self._indexes.popitem(last=False)
        self._indexes.move_to_end(request_id)
        index.extend()
        length = len(token_ids)
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            suffix = token_ids[-1] if n == 1 else tuple(token_ids[length - n :])
            start = index.last[n].get(suffix)
            if start is not None:
                return token_ids[start + n : start + n + k], n
        return [], 0

    def propose_tree_for(
        self,
        request_id: str,
        token_ids: list[int],
        max_nodes: int,
        max_depth: int,
        max_occurrences: int = 4,
    ) -> DraftTree:
        """A token tree continuing ``token_ids`` (the same list from call to call, only
        growing): what followed each of the last ``max_occurrences`` occurrences of the
        longest n-gram that ends the context and occurred before, each continuation up
        to ``max_depth`` tokens, merged (``DraftTree.from_continuations``), its
        ``max_nodes`` best nodes. Empty when nothing matches.

        A node's score is the share of those occurrences that went through it, shrunk
        by ``TREE_PSEUDO_COUNT / n``. With one occurrence the tree is ``propose_for``'s
        chain of ``min(max_nodes, max_depth)`` tokens. ``last_match_length``: the n
        matched (0: none)."""
        self.last_match_length = 0
        if max_nodes <= 0 or max_depth <= 0 or len(token_ids) < self.ngram_min + 1:
            return DraftTree()
        index = self._tree_index(request_id, token_ids)
        length = len(token_ids)
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            suffix = token_ids[-1] if n == 1 else tuple(token_ids[length - n :])
            starts = index.starts(n, suffix, max_occurrences)
            if starts:
                self.last_match_length = n
                depth = min(max_depth, max_nodes)  # no deeper than the tree can reach
                continuations = [(token_ids[s + n : s + n + depth], 1.0) for s in starts]
                return DraftTree.from_continuations(
                    continuations, max_nodes, pseudo_count=TREE_PSEUDO_COUNT / n
                )
        return DraftTree()

    def _tree_index(self, request_id: str, token_ids: list[int]) -> _OccurrenceIndex:
        index = self._tree_indexes.get(request_id)
        if index is None or index.tokens is not token_ids or len(token_ids) < index.length:
            index = _OccurrenceIndex(token_ids, self.ngram_min, self.ngram_max)
            self._tree_indexes[request_id] = index
            if len(self._tree_indexes) > MAX_INDEXED_REQUESTS:
                self._tree_indexes.popitem(last=False)
        self._tree_indexes.move_to_end(request_id)
        index.extend()
        return index

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
        self._tree_indexes.pop(request_id, None)
