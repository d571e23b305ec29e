"""Lossless verification of draft tokens (Leviathan et al. 2023; Chen et al. 2023).

For a request with k drafts ``d_1..d_k`` the target produced processed distributions
``p_1..p_{k+1}`` (one per position of ``[last_token, d_1..d_k]``) and the proposer drew
``d_i`` from ``q_i`` (a one-hot for a deterministic proposer such as n-gram lookup).

- accepted token: ``d_i`` is kept with probability ``min(1, p_i(d_i) / q_i(d_i))``,
  scanning left to right until the first rejection.
- recovered token: after the first rejection at position i, one token is sampled from
  the residual ``max(0, p_i - q_i)`` renormalised. Accepting-or-recovering makes each
  emitted token an exact sample of ``p_i``.
- bonus token: when all k drafts are accepted, one more token is sampled from
  ``p_{k+1}``, which the target computed anyway.

Greedy is the special case where every ``p`` is one-hot: a draft is accepted exactly
when it equals the target's argmax, and the recovered/bonus token is that argmax.
Nothing is coupled to the recovered or bonus token, so the verifier draws it by inverse
CDF (``final_u``, one uniform a row) rather than by the exponential race.
Everything below is batched over requests; the host reads only the results.
"""

from __future__ import annotations

import torch

from engine.sample.sampler import row_argmax, sample_rows


def rejection_sample(
    target_probs: torch.Tensor,  # [n, k_max + 1, vocab_size] processed target distributions
    draft_token_ids: torch.Tensor,  # [n, k_max] int64, padded with 0
    draft_probs: torch.Tensor | None,  # [n, k_max, vocab_size]; None = one-hot drafts
    num_drafts: torch.Tensor,  # [n] int64, drafts per request (<= k_max)
    uniforms: torch.Tensor,  # [n, k_max] U[0, 1)
    noise: torch.Tensor | None,  # [n, vocab_size] Exp(1); None = argmax (all greedy)
    final_u: torch.Tensor | None = None,  # [n] float64 U[0, 1): see below
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (output_token_ids [n, k_max + 1] padded with -1, num_accepted [n]). The
    recovered or bonus token is drawn from its distribution by inverse CDF at
    ``final_u`` when given (``sample_rows``: one uniform a row), else by the race
    ``argmax(dist / noise)``, else (``noise`` None too) it is the argmax. Either draw is
    an exact sample; the race is what coupling needs, and nothing is coupled here."""
    n, k_max = draft_token_ids.shape
    device = target_probs.device
    rows = torch.arange(n, device=device)
    p_draft = target_probs[:, :k_max].gather(2, draft_token_ids.unsqueeze(2)).squeeze(2)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, draft_token_ids.unsqueeze(2)).squeeze(2)
    # u < p/q without dividing (q > 0 for any token the proposer actually drew).
    accepted = uniforms * q_draft < p_draft  # [n, k_max]
    accepted &= torch.arange(k_max, device=device).unsqueeze(0) < num_drafts.unsqueeze(1)
    num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [n]

    # The final token comes from position num_accepted: the residual after a
    # rejection, or the bonus distribution when every draft was accepted.
    final_p = target_probs[rows, num_accepted]  # [n, vocab_size]
    rejected = num_accepted < num_drafts
    residual = final_p - _draft_dist_at(draft_token_ids, draft_probs, num_accepted, final_p)
    residual = residual.clamp_min_(0.0)
    # p == q makes a rejection impossible in exact arithmetic; guard round-off.
    has_mass = residual.sum(dim=1, keepdim=True) > 0
    residual = torch.where(has_mass, residual, final_p)
    final_dist = torch.where(rejected.unsqueeze(1), residual, final_p)
    if final_u is not None:
        final_token = sample_rows(final_dist, final_u)
    elif noise is None:
        final_token = row_argmax(final_dist)
    else:
        final_token = row_argmax(final_dist / noise)

    positions = torch.arange(k_max + 1, device=device).unsqueeze(0)
    padded_drafts = torch.cat([draft_token_ids, draft_token_ids.new_zeros((n, 1))], dim=1)
    output = torch.where(positions < num_accepted.unsqueeze(1), padded_drafts, -1)
    output[rows, num_accepted] = final_token
    return output, num_accepted


def _draft_dist_at(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    position: torch.Tensor,
    like: torch.Tensor,
) -> torch.Tensor:
    """q at ``position`` per row ([n, vocab_size]); zeros where position == num drafts
    is past the drafts (the bonus case, where it is unused)."""
    n, k_max = draft_token_ids.shape
    if k_max == 0:
        return torch.zeros_like(like)
    rows = torch.arange(n, device=like.device)
    clamped = position.clamp(max=k_max - 1)
    if draft_probs is not None:
        return draft_probs[rows, clamped]
    q = torch.zeros_like(like)
    q[rows, draft_token_ids[rows, clamped]] = 1.0
    return q
