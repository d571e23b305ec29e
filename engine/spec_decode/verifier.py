"""Turns one forward's logits into each request's new tokens: plain sampling for
requests without drafts, rejection sampling for those with drafts, batched."""

from __future__ import annotations

import torch

from engine.outputs import TokenLogprob
from engine.sampler import (
    SamplingBatch,
    compute_logprobs,
    exponential_noise,
    processed_probs,
    sample_from_probs,
    uniform_noise,
)
from engine.spec_decode.rejection_sampler import rejection_sample
from scheduler.output import ModelRunnerOutput, SchedulerOutput


class Verifier:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        # Requests without their own seed draw from this one, so a whole engine run is
        # reproducible for a fixed engine seed and arrival order.
        self.generator = torch.Generator(device).manual_seed(seed)

    def verify(
        self,
        logits: torch.Tensor,  # [sum(1 + num_drafts), vocab_size]
        sched: SchedulerOutput,
        states: list,  # engine request states, one per sampling request, in batch order
        draft_counts: list[int],
        draft_probs: list[torch.Tensor] | None,  # per speculating request [num_drafts, V]
    ) -> ModelRunnerOutput:
        items = [s for s in sched.scheduled if s.needs_sample]
        if not items:
            return ModelRunnerOutput(sampled_token_ids={})
        batch = SamplingBatch.build(
            [st.params for st in states], [st.generator for st in states], self.device
        )
        if batch.all_greedy:
            out_tokens, num_accepted = _greedy_verify(logits, items, draft_counts)
        elif not any(draft_counts):
            probs = processed_probs(logits, batch)
            tokens = sample_from_probs(probs, batch, self.generator).tolist()
            out_tokens = [[t] for t in tokens]
            num_accepted = [0] * len(items)
        else:
            out_tokens, num_accepted = self._rejection(
                logits, items, batch, draft_counts, draft_probs
            )
        result = ModelRunnerOutput(
            sampled_token_ids={s.request_id: t for s, t in zip(items, out_tokens)},
            num_accepted={s.request_id: n for s, n in zip(items, num_accepted)},
        )
        self._add_logprobs(result, logits, items, states, draft_counts, out_tokens)
        return result

    def _rejection(self, logits, items, batch, draft_counts, draft_probs):
        n = len(items)
        k_max = max(draft_counts)
        counts = [1 + c for c in draft_counts]
        probs_flat = processed_probs(logits, batch.repeat_rows(counts))  # [sum(counts), V]
        starts = [0]
        for c in counts[:-1]:
            starts.append(starts[-1] + c)
        # [n, k_max + 1] row of probs_flat for each (request, position); clamped padding
        index = [[s + min(j, c - 1) for j in range(k_max + 1)] for s, c in zip(starts, counts)]
        target_probs = probs_flat[torch.tensor(index, device=self.device)]
        drafts = [
            items[i].spec_token_ids + [0] * (k_max - len(items[i].spec_token_ids)) for i in range(n)
        ]
        draft_ids = torch.tensor(drafts, dtype=torch.long, device=self.device)
        q = self._padded_draft_probs(items, draft_probs, k_max, logits.shape[-1])
        uniforms = uniform_noise((k_max,), batch.generators, self.device, self.generator)
        noise = None
        if not batch.all_greedy:
            noise = exponential_noise(
                (logits.shape[-1],), batch.generators, self.device, self.generator
            )
            noise[torch.tensor(batch.is_greedy, device=self.device)] = 1.0
        output, num_accepted = rejection_sample(
            target_probs,
            draft_ids,
            q,
            torch.tensor(draft_counts, device=self.device),
            uniforms,
            noise,
        )
        packed = torch.cat([output, num_accepted.unsqueeze(1)], dim=1).tolist()  # one sync
        out_tokens = [row[: row[-1] + 1] for row in packed]
        return out_tokens, [row[-1] for row in packed]

    def _padded_draft_probs(self, items, draft_probs, k_max, vocab_size):
        if draft_probs is None:
            return None
        q = torch.zeros((len(items), k_max, vocab_size), device=self.device)
        it = iter(draft_probs)
        for i, item in enumerate(items):
            if item.num_spec_tokens > 0:
                probs = next(it)  # [num_drafts, V], None when the request got no drafts
                if probs is not None:
                    q[i, : probs.shape[0]] = probs
        return q

    def _add_logprobs(self, result, logits, items, states, draft_counts, out_tokens) -> None:
        offset = 0
        for item, state, count, tokens in zip(items, states, draft_counts, out_tokens):
            num_top = state.params.logprobs
            if num_top is not None:
                rows = logits[offset : offset + len(tokens)]
                chosen, top_v, top_i = compute_logprobs(
                    rows, torch.tensor(tokens, device=self.device), num_top
                )
                result.logprobs[item.request_id] = [
                    TokenLogprob(t, lp, list(zip(ids, vals)))
                    for t, lp, ids, vals in zip(
                        tokens, chosen.tolist(), top_i.tolist(), top_v.tolist()
                    )
                ]
            offset += 1 + count


def _greedy_verify(logits: torch.Tensor, items, draft_counts: list[int]):
    """All-greedy batches: the exact-match special case of rejection sampling, without
    building one-hot distributions. Drafts are kept while they equal the target's
    argmax; the first mismatch (or the position after the last draft) contributes the
    target's argmax as the recovered (or bonus) token."""
    argmax = logits.argmax(dim=-1).tolist()  # [sum(1 + drafts)], the only host sync
    out_tokens, num_accepted, offset = [], [], 0
    for item, count in zip(items, draft_counts):
        targets = argmax[offset : offset + count + 1]
        n = 0
        while n < count and item.spec_token_ids[n] == targets[n]:
            n += 1
        out_tokens.append(item.spec_token_ids[:n] + [targets[n]])
        num_accepted.append(n)
        offset += count + 1
    return out_tokens, num_accepted
