"""What verifying draft tokens costs, measured on the running engine.

A forward pass over ``n`` packed tokens takes about ``a + b * n`` seconds: ``a`` is what
every step pays (reading the weights, per-layer overhead), ``b`` the compute per token.
At batch 1 on a memory-bound machine ``b * n`` is small next to ``a`` and a handful of
verification tokens is nearly free; at batch 16 on two CPU cores the same tokens are a
large share of the step. Adaptive k needs that ratio: one extra token for each of
``B`` running requests costs ``b * B / (a + b * B)`` of a plain decode step.

``StepCostModel`` fits ``a`` and ``b`` by exponentially decayed least squares over the
engine's recent decode and verification steps (the engine leaves prefill steps out: their
large GEMMs run at a better rate per token and, with their leverage, would flatten the
slope; measured on SmolLM2 at 16 requests the slope came out 1.34 instead of
~1.7 ms/token with them in). The time is proposing + batch building + forward +
verification, everything a draft token adds to.

A draft model's burst steps get a model of their own (``DraftCostMeter``): one draft
token costs ``draft(B) / target(B)`` plain decode steps at B running requests, both
measured, so the price follows the batch and the machine instead of a parameter ratio.
"""

from __future__ import annotations


class StepCostModel:
    def __init__(self, decay: float = 0.98, min_steps: int = 8, max_tokens: int = 512) -> None:
        self.decay = decay
        self.min_steps = min_steps
        self.max_tokens = max_tokens
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self._steps = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Record one forward pass of ``num_tokens`` packed tokens."""
        if num_tokens <= 0 or num_tokens > self.max_tokens or seconds <= 0:
            return
        d = self.decay
        n = float(num_tokens)
        self._w = d * self._w + 1.0
        self._n = d * self._n + n
        self._t = d * self._t + seconds
        self._nn = d * self._nn + n * n
        self._nt = d * self._nt + n * seconds
        self._steps += 1

    def fit(self) -> tuple[float, float] | None:
        """(a, b) in seconds and seconds per token, or None without enough varied steps."""
        if self._steps < self.min_steps:
            return None
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var_n = self._nn / self._w - mean_n * mean_n
        if var_n < 1.0:  # every step had the same size: the slope is unknown
            return None
        b = max((self._nt / self._w - mean_n * mean_t) / var_n, 0.0)
        a = max(mean_t - b * mean_n, 0.05 * mean_t)  # a step never costs nothing
        return a, b

    def predict(self, num_tokens: int) -> float | None:
        """Seconds for a forward of ``num_tokens`` packed tokens; None until fitted."""
        fitted = self.fit()
        return None if fitted is None else fitted[0] + fitted[1] * num_tokens

    def verify_cost(self, batch_size: int) -> float | None:
        """One more token per request, for ``batch_size`` requests, as a fraction of a
        plain decode step of that batch; None until ``fit()`` has an answer."""
        fitted = self.fit()
        if fitted is None or batch_size <= 0:
            return None
        a, b = fitted
        return b * batch_size / (a + b * batch_size)


class DraftCostMeter:
    """A draft model's cost per draft token, in plain decode steps of the target: its
    burst steps (one token per speculating request) timed and fitted like the target's
    steps; ``prior`` (the parameter ratio) until both fits have enough steps."""

    def __init__(self, prior: float) -> None:
        self.prior = prior
        self.burst = StepCostModel(min_steps=4)

    def observe(self, num_rows: int, seconds: float) -> None:
        self.burst.observe(num_rows, seconds)

    def cost(self, batch_size: int, target: StepCostModel) -> float:
        batch_size = max(batch_size, 1)
        draft_s = self._burst_seconds(batch_size)
        target_s = target.predict(batch_size)
        if draft_s is None or target_s is None or target_s <= 0:
            return self.prior
        return draft_s / target_s

    def _burst_seconds(self, batch_size: int) -> float | None:
        seconds = self.burst.predict(batch_size)
        if seconds is None and self.burst._steps >= self.burst.min_steps:
            # every burst had the same width (batch 1): the mean is the answer there
            seconds = self.burst._t / self.burst._w
        return seconds
