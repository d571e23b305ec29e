"""The measured step-cost model behind adaptive speculation length."""

from __future__ import annotations

import random

import pytest

from scheduler.spec_length import AcceptanceHistory, choose_num_spec_tokens
from scheduler.step_cost import DraftCostMeter, StepCostModel


def test_recovers_intercept_and_slope_from_noisy_steps():
    rng = random.Random(0)
    model = StepCostModel()
    for _ in range(200):
        n = rng.randint(1, 80)
        model.observe(n, (0.030 + 0.0012 * n) * rng.uniform(0.97, 1.03))
    a, b = model.fit()
    assert a == pytest.approx(0.030, rel=0.1) and b == pytest.approx(0.0012, rel=0.1)
    # one extra token per request: cheap at batch 1, a large share of the step at 32
    assert model.verify_cost(1) == pytest.approx(0.0012 / 0.0312, rel=0.15)
    assert model.verify_cost(32) == pytest.approx(0.0384 / 0.0684, rel=0.15)


def test_no_answer_until_enough_varied_steps():
    model = StepCostModel(min_steps=8)
    for _ in range(7):
        model.observe(4, 0.01)
    assert model.fit() is None  # too few
    for _ in range(20):
        model.observe(4, 0.01)
    assert model.fit() is None and model.verify_cost(4) is None  # no spread in size
    model.observe(0, 1.0)  # ignored: empty, or past max_tokens
    model.observe(10_000, 1.0)
    assert model.fit() is None


def test_old_steps_fade():
    model = StepCostModel(decay=0.9)
    for i in range(100):
        model.observe(1 + i % 20, 0.050 + 0.002 * (1 + i % 20))
    for i in range(200):  # the machine got twice as slow per token
        model.observe(1 + i % 20, 0.050 + 0.004 * (1 + i % 20))
    assert model.fit()[1] == pytest.approx(0.004, rel=0.05)


def test_measured_cost_turns_speculation_off_at_large_batch():
    """Per-token acceptance 0.4: worth one or two drafts when verifying is nearly free,
    nothing when every verified token is a real share of the step."""
    history = AcceptanceHistory(accepted=4.0, trials=10.0)
    cheap, dear = 0.01 + 0.04, 0.01 + 0.55
    assert choose_num_spec_tokens(history, 4, cheap) >= 1
    assert choose_num_spec_tokens(AcceptanceHistory(accepted=4.0, trials=10.0), 4, dear) == 0


def test_a_draft_token_costs_the_measured_burst_step_over_the_targets_step():
    target = StepCostModel()
    for i in range(40):  # decode steps: 20 ms + 1 ms per token
        n = 1 + i % 8
        target.observe(n, 0.020 + 0.001 * n)
    meter = DraftCostMeter(prior=0.3)
    assert meter.cost(4, target) == 0.3  # no burst timed yet: the prior
    for i in range(12):  # burst steps: 2 ms + 0.5 ms per row
        rows = 1 + i % 4
        meter.observe(rows, 0.002 + 0.0005 * rows)
    assert meter.cost(1, target) == pytest.approx(0.0025 / 0.021, rel=1e-6)
    assert meter.cost(4, target) == pytest.approx(0.004 / 0.024, rel=1e-6)
    # the relative price follows the batch: a wider burst costs less per target step
    # here, because the target's per-token slope is steeper than the draft's


def test_bursts_of_one_width_are_priced_at_their_mean():
    target = StepCostModel()
    for i in range(40):
        target.observe(1 + i % 5, 0.010 + 0.001 * (1 + i % 5))
    meter = DraftCostMeter(prior=0.5)
    for _ in range(3):
        meter.observe(1, 0.003)
    assert meter.cost(1, target) == 0.5  # fewer than min_steps bursts
    meter.observe(1, 0.003)
    assert meter.cost(1, target) == pytest.approx(0.003 / 0.011, rel=1e-6)
