"""Whether speculating pays at all, judged by the engine's own clock.

Adaptive k (spec_length.py) prices each draft from models: an acceptance estimate per
request, a fitted cost per verified token, a draft step's measured share of a target
step. What those models leave out (the burst's Python overhead, the catch-up forward,
rejection sampling over the vocabulary, an acceptance estimate still near its prior)
is paid all the same, and on a CPU it is enough to make speculation a net loss at a
few concurrent requests. The gate looks at the outcome instead: for each batch-size
bucket it keeps the decode steps' output tokens per second, decayed, once for steps
that verified drafts and once for steps that did not, and closes (adaptive k = 0 for
the whole step) while the plain steps are measured faster.

Both rates stay current by exploring: while open, every ``explore_every``-th step of a
bucket runs plain; while closed, a run of ``spec_run`` speculating steps starts every
``explore_every`` steps, or less often where speculation measured so much slower that
the runs would cost more than ``explore_budget`` (2%) of the throughput (at half the
plain rate: one run in 100 steps). The first step of such a run is not counted: it pays
the catch-up of everything the draft missed while the gate was closed, which steady
speculation does not. The gate opens with no evidence, so a new engine speculates
from its first step, as adaptive k alone would.
"""

from __future__ import annotations

from dataclasses import dataclass


def bucket_of(batch_size: int) -> int:
    """1, 2, 4, 8, ...: the smallest power of two not below ``batch_size``."""
    return 1 << max(batch_size - 1, 0).bit_length()


@dataclass(slots=True)
class _Rate:
    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        self.steps += 1

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class _Bucket:
    spec: _Rate
    plain: _Rate
    steps: int = 0  # schedule decisions in this bucket
    run_left: int = 0  # speculating steps left in an exploring run (gate closed)
    closed_for: int = 0  # steps since the last exploring run began (gate closed)
    skip_next_spec: bool = False  # the next speculating step ends a closed spell


class SpeculationGate:
    def __init__(
        self,
        explore_every: int = 16,
        spec_run: int = 4,
        min_steps: int = 3,
        decay: float = 0.85,
        margin: float = 1.0,
        explore_budget: float = 0.02,
        max_explore_every: int = 128,
    ) -> None:
        self.explore_every = explore_every
        self.spec_run = spec_run
        # While closed, exploring runs come at most often enough to cost explore_budget
        # of the throughput at the measured loss: a run of spec_run steps at spec/plain
        # = r costs spec_run * (1 - r) plain steps' worth of tokens.
        self.explore_budget = explore_budget
        self.max_explore_every = max_explore_every
        self.min_steps = min_steps
        self.decay = decay
        self.margin = margin  # open while spec rate >= margin * plain rate
        self._buckets: dict[int, _Bucket] = {}
        self.num_closed_steps = 0  # steps the gate ran plain (metrics, tests)

    def _bucket(self, batch_size: int) -> _Bucket:
        key = bucket_of(batch_size)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(_Rate(), _Rate())
        return bucket

    def pays(self, batch_size: int) -> bool | None:
        """True or False once both rates of the bucket are measured, else None."""
        bucket = self._bucket(batch_size)
        if min(bucket.spec.steps, bucket.plain.steps) < self.min_steps:
            return None
        return bucket.spec.per_second >= self.margin * bucket.plain.per_second

    def allow(self, batch_size: int) -> bool:
        """Whether this step may speculate (adaptive k); called once per schedule."""
        bucket = self._bucket(batch_size)
        bucket.steps += 1
        if self.pays(batch_size) is False:
            bucket.closed_for += 1
            if bucket.closed_for >= self._closed_interval(bucket):
                bucket.closed_for = 0
                bucket.run_left = self.spec_run
            if bucket.run_left > 0:
                bucket.run_left -= 1
                return True
            bucket.skip_next_spec = True
            self.num_closed_steps += 1
            return False
        explore = bucket.steps % self.explore_every == 0
        if explore or bucket.plain.steps < self.min_steps and bucket.steps % 4 == 0:
            self.num_closed_steps += 1  # a plain step, to keep its rate measured
            return False
        return True

    def _closed_interval(self, bucket: _Bucket) -> int:
        """Steps between exploring runs while closed: explore_every, or more where
        speculation is measured so much slower that a run would cost more than the
        budget."""
        loss = 1.0 - bucket.spec.per_second / max(bucket.plain.per_second, 1e-9)
        wanted = round(self.spec_run * loss / self.explore_budget)
        return min(max(self.explore_every, wanted), self.max_explore_every)

    def observe(self, batch_size: int, speculated: bool, num_tokens: int, seconds: float) -> None:
        """One decode step's outcome: its output tokens and wall time."""
        if num_tokens <= 0 or seconds <= 0:
            return
        bucket = self._bucket(batch_size)
        if speculated:
            if bucket.skip_next_spec:  # the catch-up step after a closed spell
                bucket.skip_next_spec = False
                return
            bucket.spec.add(num_tokens, seconds, self.decay)
        else:
            bucket.plain.add(num_tokens, seconds, self.decay)

    def state(self) -> dict[int, tuple[float, float]]:
        """bucket -> (speculating, plain) output tokens per second, as measured."""
        return {
            key: (b.spec.per_second, b.plain.per_second) for key, b in sorted(self._buckets.items())
        }
