"""The speculation gate: adaptive k runs plain steps where the engine measures
speculating steps slower, keeps both rates measured, and is honest per batch size."""

from __future__ import annotations

import random

import pytest

from scheduler.spec_gate import SpeculationGate, bucket_of
from tests.scheduler.helpers import make_request, make_scheduler, step


def _run(gate: SpeculationGate, batch_size: int, steps: int, spec_rate: float, plain_rate: float,
         rng: random.Random, catch_up_s: float = 0.0) -> list[bool]:  # fmt: skip
    """``steps`` schedule decisions, each step's outcome fed back with 5% timing noise:
    ``spec_rate`` / ``plain_rate`` output tokens per second; a speculating step after a
    spell of plain ones (not a single probe) pays ``catch_up_s`` more."""
    decisions, plain_spell = [], 0
    for _ in range(steps):
        allowed = gate.allow(batch_size)
        rate = spec_rate if allowed else plain_rate
        tokens = batch_size * (2 if allowed else 1)
        seconds = tokens / rate * rng.uniform(0.95, 1.05)
        if allowed and plain_spell > 1:
            seconds += catch_up_s
        gate.observe(batch_size, allowed, tokens, seconds)
        decisions.append(allowed)
        plain_spell = 0 if allowed else plain_spell + 1
    return decisions


def test_small_batches_are_buckets_of_their_own_then_powers_of_two():
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 3, 4, 5, 8, 16, 64]


def test_plain_steps_at_another_batch_size_do_not_bend_a_bucket():
    """Issue 33, item 6: with 3 and 4 rows in one bucket, plain steps taken at 3 rows
    (a batch draining, a request between prompts) measured plain decoding slower than it
    was at 4, and the gate stayed open at 0.93x. Each small batch size is judged on its
    own: at 4 rows speculation is 7% slower here, and the gate closes."""
    gate = SpeculationGate()
    rng = random.Random(7)
    for i in range(3000):
        if i % 4 == 0:  # a plain step at 3 rows: 110 tok/s per row, as at 4
            gate.observe(3, False, 3, 3 / 330.0 * rng.uniform(0.97, 1.03))
            continue
        allowed = gate.allow(4)
        rate = 560.0 if allowed else 600.0
        gate.observe(4, allowed, 4, 4 / rate * rng.uniform(0.97, 1.03))
    assert gate.pays(4) is False


def test_closed_lanes_share_one_exploration_budget():
    """Two lanes 10% slower than plain at one batch size (n-gram's long and short
    matches at 4 concurrent requests): their exploring runs together cost about the
    one budget (2%), not 2% each."""
    gate = SpeculationGate()
    rng = random.Random(11)
    lanes = ("ngram", "ngram-short")
    spec_steps = 0
    for i in range(4000):
        if not gate.begin_step(4):
            gate.observe(4, False, 4, 4 / 600.0 * rng.uniform(0.97, 1.03))
            continue
        open_lanes = [lane for lane in lanes if gate.allow_lane(4, lane)]
        if open_lanes:
            lane = open_lanes[i % len(open_lanes)]
            gate.observe(4, True, 4, 4 / 540.0 * rng.uniform(0.97, 1.03), lane=lane)
            spec_steps += i >= 1000
        else:
            gate.observe(4, False, 4, 4 / 600.0 * rng.uniform(0.97, 1.03))
    assert all(gate.pays(4, lane) is False for lane in lanes)
    loss = spec_steps / 3000 * 0.10
    assert loss < 0.025, loss


def test_open_with_no_evidence_and_while_speculation_is_faster():
    gate = SpeculationGate()
    assert gate.pays(4) is None and gate.allow(4) is True
    decisions = _run(gate, 4, 400, spec_rate=120.0, plain_rate=100.0, rng=random.Random(0))
    assert gate.pays(4) is True
    late = decisions[100:]
    # open but for its plain probes, one step in explore_every
    assert sum(late) / len(late) == pytest.approx(1 - 1 / gate.explore_every, abs=0.02)


@pytest.mark.parametrize("spec_rate, every", [(95.0, 16), (85.0, 30), (50.0, 100), (20.0, 128)])
def test_closes_where_speculation_is_measured_slower_and_keeps_probing(spec_rate, every):
    """Closed, it explores with a run of spec_run steps every explore_every steps, or
    less often the slower speculation measures (each run then costs more): the runs
    cost about 2% of the throughput, never probing less than once in 128 steps."""
    gate = SpeculationGate()
    decisions = _run(gate, 4, 1200, spec_rate=spec_rate, plain_rate=100.0, rng=random.Random(1))
    assert gate.pays(4) is False
    late = decisions[300:]
    share = sum(late) / len(late)
    assert share == pytest.approx(gate.spec_run / every, rel=0.25), (share, every)
    assert gate.num_closed_steps > 0.6 * len(decisions)
    loss = share * (1 - spec_rate / 100.0)  # of the plain throughput
    assert loss < 0.03


def test_reopens_when_speculation_starts_to_pay_and_the_catch_up_is_not_held_against_it():
    """The first speculating step after a closed spell pays the draft's catch-up; were
    it counted, a 12% speculation win with a costly catch-up would never reopen."""
    rng = random.Random(2)
    gate = SpeculationGate()
    _run(gate, 2, 200, spec_rate=80.0, plain_rate=100.0, rng=rng)
    assert gate.pays(2) is False
    decisions = _run(gate, 2, 300, spec_rate=112.0, plain_rate=100.0, rng=rng, catch_up_s=0.2)
    assert gate.pays(2) is True
    assert sum(decisions[150:]) / 150 > 0.9


def test_batch_sizes_are_judged_apart():
    rng = random.Random(3)
    gate = SpeculationGate()
    for _ in range(30):
        _run(gate, 1, 10, spec_rate=150.0, plain_rate=100.0, rng=rng)
        _run(gate, 8, 10, spec_rate=300.0, plain_rate=400.0, rng=rng)
    assert gate.pays(1) is True and gate.pays(8) is False
    assert gate.state()[1][0] > gate.state()[1][1] and gate.state()[8][0] < gate.state()[8][1]


def test_a_closed_gate_zeroes_adaptive_k_but_not_a_fixed_k():
    scheduler = make_scheduler(num_spec_tokens=4, spec_enabled=True)
    gate = SpeculationGate(explore_every=10**6)
    scheduler.gate = gate
    adaptive = make_request("a", 8, max_tokens=50)
    fixed = make_request("f", 8, max_tokens=50, max_spec_tokens=3)
    for request in (adaptive, fixed):
        scheduler.add_request(request)
    step(scheduler)  # prefill
    gate.pays = lambda batch_size, lane=None: False  # measured slower
    k = {s.request_id: s.num_spec_tokens for s in step(scheduler).scheduled}
    assert k == {"a": 0, "f": 3}
    gate.pays = lambda batch_size, lane=None: True
    k = {s.request_id: s.num_spec_tokens for s in step(scheduler).scheduled}
    assert k["a"] > 0 and k["f"] == 3


def test_a_held_step_counts_only_when_it_held_back_an_adaptive_request():
    """num_gated_steps (the gated-steps metric) counts steps where the closed gate set
    k = 0 for a request that chooses k adaptively; a step of requests with their own
    fixed k speculates anyway and is not counted."""

    def closed_scheduler():
        s = make_scheduler(num_spec_tokens=4, spec_enabled=True)
        s.gate = SpeculationGate()
        _run(s.gate, 1, 200, spec_rate=50.0, plain_rate=100.0, rng=random.Random(2))
        assert s.gate.pays(1) is False
        return s

    fixed = closed_scheduler()
    fixed.add_request(make_request("f", 5, max_tokens=30, max_spec_tokens=2))
    step(fixed)  # prefill
    ks = [step(fixed).scheduled[0].num_spec_tokens for _ in range(8)]
    assert ks == [2] * 8 and fixed.gate.pays(1) is False
    assert fixed.num_gated_steps == 0

    adaptive = closed_scheduler()
    adaptive.add_request(make_request("a", 5, max_tokens=30))
    step(adaptive)
    ks = [step(adaptive).scheduled[0].num_spec_tokens for _ in range(8)]
    held = sum(k == 0 for k in ks)
    assert held >= 4 and adaptive.num_gated_steps == held


def test_each_lane_opens_and_closes_on_its_own_rate():
    """A hybrid proposer's lanes: draft-model steps measured at half the plain rate
    close the "model" lane, while n-gram-only steps measured faster than plain keep
    the "ngram" lane open, so requests copying their prompt keep their free drafts."""
    gate = SpeculationGate()
    rng = random.Random(3)
    rates = {"model": 50.0, "ngram": 130.0, None: 100.0}
    lanes_run = []
    for _ in range(1500):
        lane = None
        if gate.begin_step(4):
            allowed = {name: gate.allow_lane(4, name) for name in ("model", "ngram")}
            lane = "model" if allowed["model"] else "ngram" if allowed["ngram"] else None
        tokens = 4
        gate.observe(4, lane is not None, tokens, tokens / rates[lane] * rng.uniform(0.9, 1.1),
                     lane=lane)  # fmt: skip
        lanes_run.append(lane)
    assert gate.pays(4, "model") is False and gate.pays(4, "ngram") is True
    late = lanes_run[300:]
    assert late.count("ngram") / len(late) > 0.8
    assert late.count("model") / len(late) < 0.1
    assert sorted(gate.lanes(), key=str) == ["model", "ngram"]


def test_the_scheduler_holds_only_the_requests_of_a_closed_lane():
    """With the draft model's lane closed and n-gram lookup's open, a request whose
    source is the draft model gets k = 0 and one copying its prompt keeps its k."""
    s = make_scheduler(num_spec_tokens=4, spec_enabled=True)
    s.gate = SpeculationGate()
    for _ in range(60):  # measured: model steps slow, n-gram steps fast
        for lane, rate in (("model", 40.0), ("ngram", 150.0)):
            s.gate.observe(2, True, 4, 4 / rate, lane=lane)
        s.gate.observe(2, False, 2, 2 / 100.0)
    assert s.gate.pays(2, "model") is False and s.gate.pays(2, "ngram") is True
    s.spec_source = lambda request: ("ngram" if request.request_id == "copy" else "model", 0.01)
    s.add_request(make_request("copy", 5, max_tokens=200))
    s.add_request(make_request("open", 5, max_tokens=200))
    step(s)  # prefill
    ks = [
        {i.request_id: i.num_spec_tokens for i in step(s, num_accepted=4).scheduled}
        for _ in range(16)
    ]
    held = sum(k["open"] == 0 for k in ks)
    assert held >= 12 and s.num_gated_steps >= 12
    assert sum(k["copy"] > 0 for k in ks) >= 14  # all but the plain probes


def test_with_every_lane_closed_the_proposer_is_asked_only_in_exploring_runs():
    """Issue 33, item 6: with every lane closed the n-gram engine still looked up each
    request's lane every step (the lookup decides the lane), and its plain steps were
    1.5-2.4% slower than the plain engine's. A step where no closed lane explores asks
    no proposer; the exploring runs still come, as often as before."""
    s = make_scheduler(num_spec_tokens=4, spec_enabled=True)
    s.gate = SpeculationGate()
    for _ in range(60):  # both lanes measured 10% slower than plain
        for lane in ("ngram", "ngram-short"):
            s.gate.observe(2, True, 4, 4 / 90.0, lane=lane)
        s.gate.observe(2, False, 2, 2 / 100.0)
    asked = []

    def source(request):
        asked.append(request.request_id)
        return ("ngram" if request.request_id == "a" else "ngram-short", 0.0)

    s.spec_source = source
    s.add_request(make_request("a", 5, max_tokens=2000))
    s.add_request(make_request("b", 5, max_tokens=2000))
    step(s)  # prefill
    asked.clear()
    ks = [sum(i.num_spec_tokens for i in step(s, num_accepted=0).scheduled) for _ in range(400)]
    spec_steps = sum(k > 0 for k in ks)
    # asked only in the steps where a lane's exploring run is due (each lane about one
    # step in ten at a 10% loss), not in all 400
    assert len(asked) < 0.25 * 2 * 400
    assert spec_steps >= 8  # the runs still come (k from each request's history)
    assert s.num_gated_steps >= 300


@pytest.mark.parametrize("seed", range(6))
def test_a_lane_that_pays_on_average_stays_open_despite_noisy_steps(seed):
    """Short n-gram matches at batch 1 as measured on the default model: a speculating
    step keeps its one draft 25% of the time (1 or 2 tokens) and costs 1.05 plain steps,
    each step's time within ±10% and the machine's speed drifting ±20% over a few hundred
    steps: 1.19x on average, but a handful of steps can look slower than plain. The gate
    keeps the lane open (closing on a noisy dip is sticky: a closed lane is re-measured
    a few steps at a time, against a plain rate measured all along)."""
    import math

    rng = random.Random(seed)
    gate = SpeculationGate()
    opened = []
    for i in range(2000):
        allowed = gate.allow(1)
        tokens = 1 + (allowed and rng.random() < 0.25)
        speed = 1 + 0.2 * math.sin(i / 60 + seed)
        seconds = 0.01 * speed * (1.05 if allowed else 1.0) * rng.uniform(0.9, 1.1)
        gate.observe(1, allowed, tokens, seconds)
        opened.append(allowed)
    assert sum(opened[200:]) / 1800 > 0.85
