"""Prompt lookup: propose what followed the most recent earlier occurrence of the last
n tokens (n from ngram_max down to ngram_min). No weights at all."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, ngram_min: int = 1, ngram_max: int = 4) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

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
