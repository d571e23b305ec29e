"""Sampling's compiled kernels at every instruction-set level this CPU runs: the Exp(1)
noise of the exponential race (a sampled token is argmax p / E) and greedy's row
argmax. The noise must be Exp(1) to the precision the race needs (a token of
probability p wins when its E is below about p, so the small draws must be right, not
only the mean), independent between columns and between keys, and a function of its
row's key and column alone: a seeded request's noise is keyed by (seed, position) and
must not depend on the batch it is drawn in (tests/engine/test_seeded.py holds the
engine to that contract; tests/engine/test_lossless_sampling.py checks that sampled
outputs follow the target's distribution with this noise)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.io.sampling_params import SamplingParams
from engine.kernels.cpu import CpuKernels, cpu_kernels
from engine.sample.sampler import (
    SamplingBatch,
    exponential_noise,
    position_seed,
)
from tests.engine.kernel_levels import kernels_at_level, runnable_levels


@pytest.fixture(scope="module", params=runnable_levels())
def kernels(request) -> CpuKernels:
    return kernels_at_level(request)


def test_the_noise_is_exp1_down_to_its_smallest_draws(kernels):
    rows, cols = 64, 50_000
    keys = [position_seed(7, r) for r in range(rows)]
    e = kernels.exponential_rows(torch.empty(rows, cols), keys).double().flatten()
    n = e.numel()
    assert bool((e > 0).all()) and bool(torch.isfinite(e).all())
    assert e.mean().item() == pytest.approx(1.0, abs=5 / math.sqrt(n))
    assert e.var().item() == pytest.approx(1.0, abs=12 / math.sqrt(n))
    # The CDF at points from the far left (where races are decided for rare tokens) to
    # the tail: each count within 5 standard deviations of n * (1 - exp(-x)).
    for x in [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 0.5, 1.0, 2.0, 4.0, 8.0]:
        p = -math.expm1(-x)
        count = int((e < x).sum())
        assert abs(count - n * p) <= 5 * math.sqrt(n * p * (1 - p)) + 1, (x, count, n * p)
    # Kolmogorov-Smirnov against Exp(1): the 1e-6 critical value is about 2.7 / sqrt(n).
    sorted_e, _ = e.sort()
    cdf = -torch.expm1(-sorted_e)
    ranks = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks = torch.maximum((ranks - cdf).abs(), (ranks - 1 / n - cdf).abs()).max().item()
    assert ks < 2.7 / math.sqrt(n), ks


def test_the_noise_is_independent_between_columns_and_keys(kernels):
    rows, cols = 32, 40_000
    e = kernels.exponential_rows(torch.empty(rows, cols), list(range(rows))).double()
    bound = 5 / math.sqrt(cols)  # correlations of independent draws: about N(0, 1/n)
    for r in range(rows - 1):  # neighbouring keys (the unseeded keys are random; seeded
        # keys of neighbouring positions go through position_seed's mix, these do not)
        c = torch.corrcoef(torch.stack([e[r], e[r + 1]]))[0, 1].item()
        assert abs(c) < bound, (r, c)
    for lag in (1, 2, 8, 16):  # within a row, across the vector lanes and beyond
        c = torch.corrcoef(torch.stack([e[0, :-lag], e[0, lag:]]))[0, 1].item()
        assert abs(c) < bound, (lag, c)


def test_a_rows_noise_is_its_keys_alone(kernels):
    """The same key gives the same bits in any row, batch, row stride and thread count
    (64 rows run on threads, one on the caller)."""
    vocab = 1000 + 13  # a tail past the vector lanes
    keys = [position_seed(3, p) for p in range(70)]
    batch = kernels.exponential_rows(torch.empty(70, vocab), keys)
    wide = torch.zeros(70, vocab + 9)
    strided = kernels.exponential_rows(wide[:, 4 : 4 + vocab], keys[::-1])
    for r in (0, 1, 33, 69):
        alone = kernels.exponential_rows(torch.empty(1, vocab), [keys[r]])[0]
        assert torch.equal(alone, batch[r])
        assert torch.equal(alone, strided[69 - r])
    assert bool((wide[:, :4] == 0).all()) and bool((wide[:, 4 + vocab :] == 0).all())
    # Keys are 64-bit: Python ints are taken modulo 2^64 (torch's int64 keys are signed).
    neg = kernels.exponential_rows(torch.empty(1, vocab), [-1])
    assert torch.equal(neg, kernels.exponential_rows(torch.empty(1, vocab), [2**64 - 1]))
    other = kernels.exponential_rows(torch.empty(1, vocab), [keys[0] + 1])
    assert not torch.equal(other[0], batch[0])


def test_exponential_rows_refuses_what_it_cannot_fill(kernels):
    with pytest.raises(ValueError, match="float32"):
        kernels.exponential_rows(torch.empty(2, 3, dtype=torch.bfloat16), [1, 2])
    with pytest.raises(ValueError, match="one key per row"):
        kernels.exponential_rows(torch.empty(2, 3), [1])
    with pytest.raises(ValueError, match="contiguous"):
        kernels.exponential_rows(torch.empty(3, 2).t(), [1, 2])


def test_a_batchs_noise_keys_seeded_rows_by_seed_and_position():
    """The sampler's noise on the CPU: a seeded row's is position_seed(seed, position)'s
    row whatever the batch around it, a greedy row's is ones, and unseeded rows come
    from the generator (the same generator state, the same noise)."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.fail("CPU kernels failed to build; see the warning logged by cpu_kernels()")
    vocab = 500
    params = [
        SamplingParams(temperature=0.7, seed=11),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=1.0, seed=12),
    ]
    positions = [5, 9, 2, 40]
    batch = SamplingBatch.build(params, positions, torch.device("cpu"))
    noise = exponential_noise(batch, vocab, torch.device("cpu"), torch.Generator().manual_seed(1))
    for i in (0, 3):
        key = position_seed(params[i].seed, positions[i])
        assert torch.equal(noise[i], kernels.exponential_rows(torch.empty(1, vocab), [key])[0])
        alone = SamplingBatch.build([params[i]], [positions[i]], torch.device("cpu"))
        assert torch.equal(noise[i], exponential_noise(alone, vocab, torch.device("cpu"), None)[0])
    assert bool((noise[1] == 1).all())
    again = exponential_noise(batch, vocab, torch.device("cpu"), torch.Generator().manual_seed(1))
    assert torch.equal(noise, again)
    other = exponential_noise(batch, vocab, torch.device("cpu"), torch.Generator().manual_seed(2))
    assert torch.equal(other[[0, 1, 3]], noise[[0, 1, 3]]) and not torch.equal(other[2], noise[2])


def test_inverse_cdf_takes_the_first_index_past_u_and_never_a_zero(kernels):
    """sample_rows: the kernel's token is the torch rule's (cumsum in double, first
    index past u times the sum) on random rows, strided and on threads; a token of
    probability 0 is never taken, at u = 0 and at the largest u below 1 too."""
    from engine.sample.sampler import sample_rows

    gen = torch.Generator().manual_seed(4)
    rows, vocab = 70, 3001
    wide = torch.rand(rows, vocab + 5, generator=gen)
    probs = wide[:, 2 : 2 + vocab]
    probs[probs < 0.5] = 0.0  # half the vocabulary at probability 0
    probs[3] = 0.0
    probs[3, 17] = 0.25  # one token only
    probs[4, :100] = 0.0
    u = torch.rand(rows, dtype=torch.float64, generator=gen)
    u[0], u[1], u[4] = 0.0, 1.0 - 2.0**-53, 0.0
    ours = kernels.sample_rows(probs, u)
    running = probs.double().cumsum(dim=-1)
    expected = torch.searchsorted(running, (u * running[:, -1]).unsqueeze(1), right=True)
    last = vocab - 1 - (probs.flip(-1) > 0).to(torch.int64).argmax(dim=-1)
    assert torch.equal(ours, torch.minimum(expected.squeeze(1), last))
    assert bool((probs[torch.arange(rows), ours] > 0).all())
    assert ours[3] == 17 and ours[1] == last[1]
    assert ours[0] == int((probs[0] > 0).to(torch.int64).argmax())
    assert ours[4] == 100 + int((probs[4, 100:] > 0).to(torch.int64).argmax())
    assert torch.equal(kernels.sample_rows(probs[5:6], u[5:6]), ours[5:6])
    # The sampler's own function: the kernel on the CPU, torch's rule where it cannot.
    assert torch.equal(sample_rows(probs, u), ours)
    assert torch.equal(sample_rows(probs.double(), u), ours)  # not fp32: torch's path


def test_inverse_cdf_draws_follow_the_distribution(kernels):
    p = torch.tensor([0.1, 0.0, 0.3, 0.6, 0.0, 1e-3], dtype=torch.float32)
    p = p / p.sum()
    n = 400_000
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    drawn = kernels.sample_rows(p.expand(n, -1).contiguous(), u)
    counts = torch.bincount(drawn, minlength=6).double()
    expected = n * p.double()
    assert counts[1] == 0 and counts[4] == 0
    for t in (0, 2, 3, 5):
        sd = (expected[t] * (1 - p[t].double())).sqrt()
        assert abs(counts[t] - expected[t]) <= 5 * sd, (t, counts[t], expected[t])


def test_sample_rows_refuses_what_it_cannot_read(kernels):
    u = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="float32"):
        kernels.sample_rows(torch.ones(2, 3, dtype=torch.bfloat16), u)
    with pytest.raises(ValueError, match="float64"):
        kernels.sample_rows(torch.ones(2, 3), torch.zeros(2))
    with pytest.raises(ValueError, match=r"\[2\]"):
        kernels.sample_rows(torch.ones(2, 3), torch.zeros(3, dtype=torch.float64))
