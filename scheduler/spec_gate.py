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
the runs would cost more than ``explore_budget`` (2%, shared by the bucket's closed
lanes) of the throughput (at half the
plain rate: one run in 100 steps). The first step of such a run is not counted: it pays
the catch-up of everything the draft missed while the gate was closed, which steady
speculation does not. The gate opens with no evidence, so a new engine speculates
from its first step, as adaptive k alone would.

A proposer that names a source per request (``source_for``: n-gram lookup's "ngram"
for a match of 3 or more tokens and "ngram-short" for a shorter one, hybrid's "model"
for the draft model) is gated per source, its *lane*: a step counts for the costliest
lane among its speculating rows (``step_lane``), and each lane opens and closes on its
own rate against the shared plain rate. Drafts that do not pay (a draft model's burst,
or one-token matches that are seldom right) then no longer hold back the n-gram drafts
of a request copying its prompt, which cost nothing and are mostly accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Batch sizes up to this are buckets of their own: a small batch's step time and tokens
# per step change with every request, and a bucket mixing 3 and 4 rows compared plain
# steps and speculating steps taken at different mixes (issue 33: at 4 concurrent the
# plain rate of bucket 4 came out 546 tok/s against 645 measured, and the gate stayed
# open at 0.93x).
EXACT_BUCKETS = 8


def bucket_of(batch_size: int) -> int:
    """The batch size itself up to EXACT_BUCKETS, then 16, 32, 64, ...: the smallest
    power of two not below it."""
    if batch_size <= EXACT_BUCKETS:
        return max(batch_size, 1)
    return 1 << (batch_size - 1).bit_length()


# Lanes by what a step of theirs costs beside plain decoding, the costliest first.
_LANE_ORDER = ("model", "ngram-short", "suffix-short", "ngram", "suffix")


def step_lane(sources: set[str | None]) -> str | None:
    """The lane a speculating step counts for, from its rows' draft sources: the draft
    model's where it ran (its burst is the step's extra cost), else the short matches'
    (the drafts least often kept)."""
    for lane in _LANE_ORDER:
        if lane in sources:
            return lane
    return next(iter(sources), None)


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
class _Lane:
    spec: _Rate = field(default_factory=_Rate)
    run_left: int = 0  # speculating steps left in an exploring run (lane closed)
    closed_for: int = 0  # steps since the last exploring run began (lane closed)
    skip_next_spec: bool = False  # the next speculating step ends a closed spell


@dataclass(slots=True)
class _Bucket:
    plain: _Rate = field(default_factory=_Rate)
    lanes: dict[str | None, _Lane] = field(default_factory=dict)
    steps: int = 0  # schedule decisions in this bucket

    def lane(self, lane: str | None) -> _Lane:
        state = self.lanes.get(lane)
        if state is None:
            state = self.lanes[lane] = _Lane()
        return state


class SpeculationGate:
    def __init__(
        self,
        explore_every: int = 16,
        spec_run: int = 4,
        min_steps: int = 3,
        decay: float = 0.93,
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
        # Refusals: plain probe steps and a closed lane's refused steps (one per lane;
        # the scheduler's num_gated_steps counts held steps for the metric)
        self.num_closed_steps = 0

    def _bucket(self, batch_size: int) -> _Bucket:
        key = bucket_of(batch_size)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket()
        return bucket

    def pays(self, batch_size: int, lane: str | None = None) -> bool | None:
        """True or False once the lane's rate and the plain rate of the bucket are
        measured, else None."""
        bucket = self._bucket(batch_size)
        spec = bucket.lane(lane).spec
        if min(spec.steps, bucket.plain.steps) < self.min_steps:
            return None
        return spec.per_second >= self.margin * bucket.plain.per_second

    def allow(self, batch_size: int, lane: str | None = None) -> bool:
        """Whether this step may speculate (adaptive k), for a proposer with one lane:
        ``begin_step`` and ``allow_lane`` together."""
        return self.begin_step(batch_size) and self.allow_lane(batch_size, lane)

    def begin_step(self, batch_size: int) -> bool:
        """Called once per schedule; False for a plain step: one that keeps the plain
        rate measured while some lane is open, or one where every lane is closed and
        none explores (the scheduler then asks no proposer which lane a request is in)."""
        bucket = self._bucket(batch_size)
        bucket.steps += 1
        if bucket.lanes and all(self.pays(batch_size, lane) is False for lane in bucket.lanes):
            if any(self._run_due(batch_size, bucket, lane) for lane in bucket.lanes.values()):
                return True  # allow_lane answers each lane, exploring where its run is due
            # Every lane closed and none exploring: the whole step is plain, and the
            # proposer's lookups that would only learn each request's lane are skipped
            # (issue 33: they made the n-gram engine's plain steps 1.5-2.4% slower than
            # the plain engine's at 4 requests).
            for lane in bucket.lanes.values():
                lane.closed_for += 1
                lane.skip_next_spec = True  # as allow_lane's refusal would
            self.num_closed_steps += 1
            return False
        explore = bucket.steps % self.explore_every == 0
        if explore or bucket.plain.steps < self.min_steps and bucket.steps % 4 == 0:
            self.num_closed_steps += 1
            return False
        return True

    def allow_lane(self, batch_size: int, lane: str | None = None) -> bool:
        """Whether requests drafting from ``lane`` may speculate this step; called at
        most once per lane per schedule, after ``begin_step`` allowed the step."""
        bucket = self._bucket(batch_size)
        state = bucket.lane(lane)
        if self.pays(batch_size, lane) is not False:
            return True
        state.closed_for += 1
        if state.closed_for >= self._closed_interval(batch_size, bucket, state):
            state.closed_for = 0
            state.run_left = self.spec_run
        if state.run_left > 0:
            state.run_left -= 1
            return True
        state.skip_next_spec = True
        self.num_closed_steps += 1
        return False

    def _run_due(self, batch_size: int, bucket: _Bucket, lane: _Lane) -> bool:
        """Whether a closed lane explores if asked this step: in a run, or one starts."""
        if lane.run_left > 0:
            return True
        return lane.closed_for + 1 >= self._closed_interval(batch_size, bucket, lane)

    def _closed_interval(self, batch_size: int, bucket: _Bucket, lane: _Lane) -> int:
        """Steps between exploring runs while closed: explore_every, or more where
        speculation is measured so much slower that a run would cost more than the
        budget. The budget is the bucket's, shared by its closed lanes: each lane
        exploring on a budget of its own cost 2% per closed lane (issue 33: at 4
        concurrent requests two closed n-gram lanes explored 17% of the steps at a 10%
        loss)."""
        closed = sum(self.pays(batch_size, name) is False for name in bucket.lanes)
        budget = self.explore_budget / max(closed, 1)
        loss = 1.0 - lane.spec.per_second / max(bucket.plain.per_second, 1e-9)
        wanted = round(self.spec_run * loss / budget)
        return min(max(self.explore_every, wanted), self.max_explore_every)

    def observe(
        self,
        batch_size: int,
        speculated: bool,
        num_tokens: int,
        seconds: float,
        lane: str | None = None,
    ) -> None:
        """One decode step's outcome: its output tokens and wall time, and the lane
        whose drafts it verified (``step_lane`` of its rows' sources)."""
        if num_tokens <= 0 or seconds <= 0:
            return
        bucket = self._bucket(batch_size)
        if speculated:
            state = bucket.lane(lane)
            if state.skip_next_spec:  # the catch-up step after a closed spell
                state.skip_next_spec = False
                return
            state.spec.add(num_tokens, seconds, self.decay)
        else:
            bucket.plain.add(num_tokens, seconds, self.decay)

    def state(self, lane: str | None = None) -> dict[int, tuple[float, float]]:
        """bucket -> (speculating in ``lane``, plain) output tokens per second, as
        measured."""
        return {
            key: (b.lane(lane).spec.per_second, b.plain.per_second)
            for key, b in sorted(self._buckets.items())
        }

    def lanes(self) -> list[str | None]:
        """The lanes measured so far, in any bucket."""
        seen: dict[str | None, None] = {}
        for bucket in self._buckets.values():
            seen.update(dict.fromkeys(bucket.lanes))
        return list(seen)
