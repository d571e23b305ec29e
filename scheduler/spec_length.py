"""Adaptive speculation length.

Each request keeps a decayed count of accepted drafts and of "trials" (an accepted
draft, or the first rejection that ends a run). ``accepted / trials`` estimates the
per-token acceptance rate ``a``; with ``k`` drafts one verification step yields
``(1 - a^(k+1)) / (1 - a)`` tokens in expectation (Leviathan et al. 2023) and costs
about ``1 + draft_cost * k`` plain decode steps. We pick the k with the best ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

_DECAY = 0.8
_PRIOR_ACCEPTED = 2.0  # optimistic prior: a = 2/3 until the request shows otherwise
_PRIOR_TRIALS = 3.0
# Requests that settle on k = 0 still probe with one draft every this many steps,
# so a request whose text turns repetitive gets speculation back.
_PROBE_INTERVAL = 8


@dataclass(slots=True)
class AcceptanceHistory:
    accepted: float = _PRIOR_ACCEPTED
    trials: float = _PRIOR_TRIALS
    steps_without_spec: int = 0
    decay: float = _DECAY  # per verification; slower for engine-wide estimates

    @property
    def rate(self) -> float:
        return self.accepted / self.trials if self.trials > 0 else 0.0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        rejected = 1 if num_accepted < num_drafts else 0
        self.accepted = self.decay * self.accepted + num_accepted
        self.trials = self.decay * self.trials + num_accepted + rejected


def expected_tokens_per_step(rate: float, k: int) -> float:
    """Expected tokens one verification of k drafts yields at acceptance rate ``rate``."""
    if rate >= 1.0:
        return float(k + 1)
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


def choose_num_spec_tokens(history: AcceptanceHistory, max_k: int, draft_cost: float) -> int:
    """The k in [0, max_k] with the most expected tokens per unit of step cost."""
    if max_k <= 0:
        return 0
    rate = min(history.rate, 0.99)
    best_k, best_value = 0, 1.0
    for k in range(1, max_k + 1):
        value = expected_tokens_per_step(rate, k) / (1.0 + draft_cost * k)
        if value > best_value * 1.02:  # demand a real gain for each extra draft
            best_k, best_value = k, value
    if best_k == 0:
        history.steps_without_spec += 1
        if history.steps_without_spec >= _PROBE_INTERVAL:
            history.steps_without_spec = 0
            return 1
    else:
        history.steps_without_spec = 0
    return best_k
