"""The verifier keeps each row's own draft distribution when one batch mixes proposers.

An n-gram draft is deterministic (q is one-hot), a draft-model draft comes with its q.
Rejection sampling accepts a draft d with probability min(1, p(d) / q(d)); with q left
at zero for the n-gram rows of a batch that also holds a draft-model row, every n-gram
draft with p(d) > 0 was accepted (issue 24: 5% alone, 100% beside a model request).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.io.sampling_params import SamplingParams
from engine.spec_decode.verifier import Verifier
from scheduler.output import ScheduledRequest, SchedulerOutput

V = 8
P_DRAFT = 0.05  # the target's probability of the n-gram draft
NUM_NGRAM = 4000


def _request(request_id: str, draft: list[int]) -> tuple[ScheduledRequest, SimpleNamespace]:
    item = ScheduledRequest(request_id, 10, 1 + len(draft), [1], True, len(draft), list(draft))
    state = SimpleNamespace(
        params=SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True),
        request=SimpleNamespace(num_tokens=10),
    )
    return item, state


def _target_rows() -> torch.Tensor:
    """[2, V] log-probabilities: p(5) = P_DRAFT at the draft's position, then uniform."""
    first = torch.full((V,), (1 - P_DRAFT) / (V - 1))
    first[5] = P_DRAFT
    return torch.stack([first, torch.full((V,), 1 / V)]).log()


def _verify_batch(with_model_row: bool, seed: int):
    """NUM_NGRAM n-gram requests drafting 5, after one draft-model request if asked."""
    pairs = [_request(f"ngram{i}", [5]) for i in range(NUM_NGRAM)]
    draft_probs = {}
    if with_model_row:
        pairs.insert(0, _request("model", [3]))
        draft_probs["model"] = torch.full((1, V), 1 / V)  # [num_drafts, V]
    items = [item for item, _ in pairs]
    logits = torch.cat([_target_rows() for _ in pairs])  # [2 * len(pairs), V]
    sched = SchedulerOutput(items, 0)
    drafts = [item.spec_token_ids for item in items]
    verifier = Verifier(torch.device("cpu"), seed)
    return verifier.verify(logits, sched, [state for _, state in pairs], drafts, draft_probs)


def _ngram_acceptance(with_model_row: bool) -> float:
    out = _verify_batch(with_model_row, seed=0)
    return sum(out.num_accepted[f"ngram{i}"] for i in range(NUM_NGRAM)) / NUM_NGRAM


def test_ngram_drafts_keep_their_acceptance_beside_a_draft_model_row():
    alone = _ngram_acceptance(with_model_row=False)
    mixed = _ngram_acceptance(with_model_row=True)
    # Binomial(4000, 0.05): standard deviation 0.0034; +-0.02 is about 6 of them.
    assert abs(alone - P_DRAFT) < 0.02, alone
    assert abs(mixed - P_DRAFT) < 0.02, mixed


def test_a_rejected_ngram_draft_is_recovered_from_the_rest_of_p():
    """After rejecting d = 5 the token comes from the residual p - one_hot(5): the first
    token is an exact sample of p, in a mixed batch too."""
    out = _verify_batch(with_model_row=True, seed=1)
    firsts = [out.sampled_token_ids[f"ngram{i}"][0] for i in range(NUM_NGRAM)]
    counts = torch.bincount(torch.tensor(firsts), minlength=V).float() / NUM_NGRAM
    expected = _target_rows()[0].exp()
    assert 0.5 * (counts - expected).abs().sum() < 0.03, counts
