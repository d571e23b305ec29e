"""The rejection sampler keeps exactly the target's distribution.

A synthetic Markov "model" (target table P[prev] and draft table Q[prev] over a tiny
vocabulary) lets us compute the exact probability of every sequence, sample many
sequences through speculative steps, and compare. Two broken samplers (one that
skips the residual, one that skips the bonus token) must fail the same check, so the
test has the power to catch those bugs.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.sample.rejection_sampler import rejection_sample
from engine.sample.sampler import row_argmax, sample_rows
from scheduler.spec_length import expected_tokens_per_step

V = 4
K = 2  # drafts per step; one verification yields up to K + 1 = 3 tokens
SEQ_LEN = 3
NUM_SAMPLES = 20000


def _tables(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(V, V, generator=g) * 1.5, dim=-1)  # [prev, next]
    draft = torch.softmax(torch.randn(V, V, generator=g) * 1.5, dim=-1)
    return target, draft


def _exact(target: torch.Tensor, start: int) -> dict[tuple[int, ...], float]:
    exact = {}
    for seq in itertools.product(range(V), repeat=SEQ_LEN):
        p, prev = 1.0, start
        for tok in seq:
            p *= float(target[prev, tok])
            prev = tok
        exact[seq] = p
    return exact


def _speculative_samples(target, draft, start, sampler, seed: int) -> torch.Tensor:
    """NUM_SAMPLES sequences of SEQ_LEN tokens, each from ONE verification step of
    K drafts (+ a plain step if rejection ended it early), batched over samples."""
    g = torch.Generator().manual_seed(seed)
    n = NUM_SAMPLES
    prev = torch.full((n,), start)
    drafts, q_rows = [], []
    for _ in range(K):  # the draft burst
        q = draft[prev]  # [n, V]
        tok = torch.multinomial(q, 1, generator=g).squeeze(1)
        drafts.append(tok)
        q_rows.append(q)
        prev = tok
    draft_ids = torch.stack(drafts, dim=1)  # [n, K]
    draft_probs = torch.stack(q_rows, dim=1)  # [n, K, V]
    context = torch.cat([torch.full((n, 1), start), draft_ids], dim=1)  # [n, K + 1]
    target_probs = target[context]  # [n, K + 1, V]: p at each verified position
    uniforms = torch.rand((n, K), generator=g)
    noise = torch.empty((n, V)).exponential_(generator=g)
    out, num_acc = sampler(
        target_probs, draft_ids, draft_probs, torch.full((n,), K), uniforms, noise
    )
    # Finish short sequences with plain target sampling (what later steps would do).
    seqs = out.clone()
    for pos in range(1, SEQ_LEN):
        missing = seqs[:, pos] < 0
        if missing.any():
            p = target[seqs[missing, pos - 1]]
            seqs[missing, pos] = torch.multinomial(p, 1, generator=g).squeeze(1)
    return seqs[:, :SEQ_LEN]


def _total_variation(samples: torch.Tensor, exact: dict) -> float:
    counts: dict[tuple[int, ...], int] = {}
    for row in samples.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return 0.5 * sum(abs(counts.get(s, 0) / len(samples) - p) for s, p in exact.items())


# With 20000 samples over 64 outcomes the TV distance of a correct sampler is about
# 0.02-0.03 (fixed seeds make it deterministic); the broken samplers below land >= 0.06.
TV_BOUND = 0.045


def test_speculative_sampling_matches_the_target_distribution():
    target, draft = _tables()
    exact = _exact(target, start=0)
    samples = _speculative_samples(target, draft, 0, rejection_sample, seed=1)
    assert _total_variation(samples, exact) < TV_BOUND


def _inverse_cdf_final(target_probs, draft_ids, draft_probs, num_drafts, uniforms, noise):
    # What the verifier runs for unseeded rows: the recovered or bonus token by inverse
    # CDF at one uniform a row (sample_rows) instead of the race with ``noise``.
    u = torch.rand(len(draft_ids), dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    return rejection_sample(target_probs, draft_ids, draft_probs, num_drafts, uniforms, None, u)


def test_speculative_sampling_by_inverse_cdf_matches_the_target_distribution():
    target, draft = _tables()
    exact = _exact(target, start=0)
    samples = _speculative_samples(target, draft, 0, _inverse_cdf_final, seed=1)
    assert _total_variation(samples, exact) < TV_BOUND


def _skip_residual(
    target_probs, draft_ids, draft_probs, num_drafts, uniforms, noise, final_u=None
):  # fmt: skip
    # Bug: after a rejection, sample the recovered token from p instead of max(0, p - q)
    # (drawn as the sampler draws: by the race, or by inverse CDF at final_u).
    out, n_acc = rejection_sample(
        target_probs, draft_ids, draft_probs, num_drafts, uniforms, noise, final_u
    )
    rows = torch.arange(len(out))
    rejected = n_acc < num_drafts
    p_at = target_probs[rows, n_acc]
    resample = sample_rows(p_at, final_u) if final_u is not None else (p_at / noise).argmax(1)
    out[rows[rejected], n_acc[rejected]] = resample[rejected]
    return out, n_acc


def _skip_bonus(target_probs, draft_ids, draft_probs, num_drafts, uniforms, noise):
    # Bug: when every draft is accepted, take the extra token from the draft model
    # instead of sampling the bonus from the target's last position.
    out, n_acc = rejection_sample(target_probs, draft_ids, draft_probs, num_drafts, uniforms, noise)
    rows = torch.arange(len(out))
    all_acc = n_acc == num_drafts
    last_q = draft_probs[rows, -1]
    wrong = (last_q / noise).argmax(dim=1)
    out[rows[all_acc], n_acc[all_acc]] = wrong[all_acc]
    return out, n_acc


@pytest.mark.parametrize("broken", [_skip_residual, _skip_bonus])
def test_the_check_catches_broken_samplers(broken):
    target, draft = _tables()
    exact = _exact(target, start=0)
    samples = _speculative_samples(target, draft, 0, broken, seed=1)
    assert _total_variation(samples, exact) > TV_BOUND


def test_greedy_is_exact_match():
    p = torch.zeros(1, 4, 6)
    p[0, torch.arange(4), torch.tensor([3, 1, 4, 5])] = 1.0  # one-hot target argmaxes
    drafts = torch.tensor([[3, 1, 2]])  # third draft is wrong
    out, n = rejection_sample(p, drafts, None, torch.tensor([3]), torch.rand(1, 3), None)
    assert n.tolist() == [2]
    assert out.tolist() == [[3, 1, 4, -1]]  # accepted, accepted, recovered = argmax


def test_all_accepted_gets_the_bonus_token():
    p = torch.zeros(1, 3, 6)
    p[0, torch.arange(3), torch.tensor([2, 2, 5])] = 1.0
    out, n = rejection_sample(
        p, torch.tensor([[2, 2]]), None, torch.tensor([2]), torch.rand(1, 2), None
    )
    assert n.tolist() == [2] and out.tolist() == [[2, 2, 5]]


def test_rows_without_drafts_are_plain_samples():
    p = torch.zeros(2, 2, 5)
    p[0, 0, 4] = p[1, 0, 1] = p[1, 1, 3] = 1.0
    p[0, 1, 0] = 1.0
    out, n = rejection_sample(
        p, torch.tensor([[0], [1]]), None, torch.tensor([0, 1]), torch.rand(2, 1), None
    )
    assert out.tolist() == [[4, -1], [1, 3]] and n.tolist() == [0, 1]


def test_tokens_per_step_follows_the_leviathan_expectation():
    # Position-independent p and q make acceptance i.i.d. with rate a = sum(min(p, q)).
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(V, generator=g), dim=0)
    q = torch.softmax(torch.randn(V, generator=g), dim=0)
    a = float(torch.minimum(p, q).sum())
    n, k = 20000, 4
    drafts = torch.multinomial(q.expand(n, V), k, replacement=True, generator=g)
    out, num_acc = rejection_sample(
        p.expand(n, k + 1, V),
        drafts,
        q.expand(n, k, V),
        torch.full((n,), k),
        torch.rand((n, k), generator=g),
        torch.empty((n, V)).exponential_(generator=g),
    )
    mean_tokens = float((num_acc + 1).float().mean())
    assert mean_tokens == pytest.approx(expected_tokens_per_step(a, k), rel=0.03)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_takes_the_first_maximal_index_as_argmax_does(dtype):
    """Greedy tokens come from row_argmax (torch's max(dim), faster than argmax): on rows
    full of ties, with NaNs (maximal) and rows of -inf, it must pick exactly the index
    argmax picks, the first maximal one, or greedy outputs would drift from
    transformers' on tied logits."""
    g = torch.Generator().manual_seed(11)
    for trial in range(60):
        rows = int(torch.randint(1, 40, (1,), generator=g))
        cols = int(torch.randint(1, 50_000, (1,), generator=g))
        x = torch.randint(-2, 3, (rows, cols), generator=g).float()  # many ties
        if trial % 3 == 0:
            x[0, int(torch.randint(0, cols, (1,), generator=g))] = float("nan")
        if trial % 4 == 0:
            x[-1] = float("-inf")
        x = x.to(dtype)
        assert torch.equal(row_argmax(x), x.argmax(dim=-1)), (trial, rows, cols)
    tied = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]], dtype=dtype)
    assert row_argmax(tied).tolist() == [1, 0]
