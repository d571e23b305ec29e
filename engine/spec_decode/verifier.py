"""Turns one forward's logits into each request's new tokens, batched.

Each sampling request contributes ``1 + k`` rows (``[last_token, d_1..d_k]``; k = 0
without drafts). Rows are verified one of two ways:

- coupling, for greedy and seeded requests: the target's own sample ``y_j`` is drawn at
  every position with the request's per-position noise (for greedy, the argmax), and a
  draft is kept exactly when it equals that sample. The output is ``d_1..d_n, y_{n+1}``
  where n drafts matched: token for token what the request would produce without
  speculation, whatever k and the batch, and an exact sample of the target, because
  the draft proposed under the same noise (engine/sample/sampler.py).
- rejection sampling, for unseeded random requests (engine/sample/rejection_sampler.py): the most
  drafts accepted for a given draft distribution, with noise from the engine's
  generator.

A token tree (engine/spec_decode/paths.py) is verified by coupling whatever the
request: the walk from the root keeps the child holding the target's sample at each
row; an unseeded request's noise then comes from the engine's generator, one draw per
row, which is an exact sample at every position the walk reads.

Penalties, logit bias and min_tokens adjust each row under the tokens before it
(engine/sample/logits_processor.py), then a structured-output constraint masks each row
to what it allows after the drafts before it (engine/sample/grammar.py), before either
form runs, so both stay exact with them. Logprobs are the raw model's.
"""

from __future__ import annotations

import torch

from engine.io.outputs import TokenLogprob
from engine.sample.grammar import apply_greedy_masks, apply_masks, uses_lazy_masks
from engine.sample.logits_processor import LogitsAdjustment
from engine.sample.rejection_sampler import rejection_sample
from engine.sample.sampler import (
    SamplingBatch,
    compute_logprobs,
    exponential_noise,
    final_uniforms,
    processed_probs,
    row_argmax,
    sample_rows,
    uniform_noise,
)
from engine.spec_decode import paths
from scheduler.output import ModelRunnerOutput, SchedulerOutput


class Verifier:
    def __init__(self, device: torch.device, seed: int, eos_token_id: int = 0) -> None:
        self.device = device
        self.eos_token_id = eos_token_id  # what a constraint's dead end ends with
        # Requests without their own seed draw from this one, so a whole engine run is
        # reproducible for a fixed engine seed and arrival order.
        self.generator = torch.Generator(device).manual_seed(seed)

    def verify(
        self,
        logits: torch.Tensor,  # [sum(1 + num_drafts), vocab_size]
        sched: SchedulerOutput,
        states: list,  # engine request states, one per sampling request, in batch order
        drafts: list[list[int]],  # per sampling request, possibly empty
        draft_probs: dict[str, torch.Tensor],  # request id -> [num_drafts, V] (draft model)
        masks: dict[str, torch.Tensor] | None = None,  # request id -> [1 + drafts, words]
        parents: list[list[int] | None] | None = None,  # per sampling request; None: chains
    ) -> ModelRunnerOutput:
        items = [s for s in sched.scheduled if s.needs_sample]
        if not items:
            return ModelRunnerOutput(sampled_token_ids={})
        parents = parents or [None] * len(drafts)
        adjusted = self._adjusted(logits, states, drafts, parents)
        lazy = any(getattr(st, "grammar", None) and uses_lazy_masks(st.params) for st in states)
        if masks or lazy:
            if adjusted is logits and any(st.params.logprobs is not None for st in states):
                adjusted = logits.clone()  # logprobs stay the raw model's
            if masks:
                apply_masks(adjusted, states, drafts, masks, self.eos_token_id, parents)
            if lazy:
                apply_greedy_masks(adjusted, states, drafts, self.eos_token_id, parents)
        if all(st.params.is_greedy for st in states):
            out_tokens, accepted = _greedy_verify(adjusted, drafts, parents)
        else:
            out_tokens, accepted = self._sample(
                adjusted, items, states, drafts, draft_probs, parents
            )
        result = ModelRunnerOutput(
            sampled_token_ids={s.request_id: t for s, t in zip(items, out_tokens)},
            num_accepted={s.request_id: len(a) for s, a in zip(items, accepted)},
        )
        for item, state, tree, nodes in zip(items, states, parents, accepted):
            if tree is not None:
                result.accepted_nodes[item.request_id] = nodes
            grammar = getattr(state, "grammar", None)
            if grammar is not None:  # dead rows off the kept path were never reached
                grammar.keep_dead_rows(paths.accepted_rows(nodes), state.request.num_output_tokens)
        self._add_logprobs(result, logits, items, states, drafts, out_tokens, accepted)
        return result

    def _adjusted(self, logits, states, drafts, parents) -> torch.Tensor:
        """The logits under penalties, logit bias and min_tokens; row j of a request
        counts the drafts before it. The logits themselves when nobody uses them, and
        adjusted in place when nobody asked for logprobs (which stay the raw model's)."""
        if not any(st.params.processes_logits for st in states):
            return logits
        adjustment = LogitsAdjustment.build(
            [st.request for st in states],
            [st.params for st in states],
            drafts,
            [1 + len(d) for d in drafts],
            logits.shape[-1],
            self.device,
            parents,
        )
        if adjustment is None:
            return logits
        # The raw logits are read again only for logprobs.
        return adjustment.apply(logits, in_place=all(st.params.logprobs is None for st in states))

    def _sample(self, logits, items, states, drafts, draft_probs, parents):
        counts = [1 + len(d) for d in drafts]
        starts = [0]
        for c in counts[:-1]:
            starts.append(starts[-1] + c)
        positions = [st.request.num_tokens for st in states]
        offsets = [[0, *paths.depths(p, len(d))] for d, p in zip(drafts, parents)]
        batch = SamplingBatch.build([st.params for st in states], positions, self.device)
        batch = batch.repeat_rows(counts, offsets)  # one row per verified position
        probs = processed_probs(logits, batch)  # [sum(counts), V]
        is_coupled = [
            st.params.seed is not None or st.params.is_greedy or tree is not None
            for st, tree in zip(states, parents)
        ]
        coupled = [i for i, c in enumerate(is_coupled) if c]
        raced = [i for i, c in enumerate(is_coupled) if not c]
        pieces = []  # flattened on the device, read back in one sync
        if coupled:
            rows = [starts[i] + j for i in coupled for j in range(counts[i])]
            chosen = batch.select(rows)
            noise = exponential_noise(chosen, probs.shape[-1], self.device, self.generator)
            pieces.append(row_argmax(probs[rows] / noise))  # [len(rows)]
        if raced:
            pieces.append(self._rejection(probs, starts, raced, items, drafts, draft_probs))
        flat = torch.cat(pieces).tolist()
        out_tokens: list[list[int]] = [[] for _ in states]
        accepted: list[list[int]] = [[] for _ in states]
        offset = 0
        for i in coupled:
            samples = flat[offset : offset + counts[i]]
            out_tokens[i], accepted[i] = paths.walk(drafts[i], parents[i], samples)
            offset += counts[i]
        width = 2 + max(len(drafts[i]) for i in raced) if raced else 0
        for i in raced:
            row = flat[offset : offset + width]
            accepted[i] = list(range(row[-1]))
            out_tokens[i] = row[: row[-1] + 1]
            offset += width
        return out_tokens, accepted

    def _rejection(self, probs, starts, raced, items, drafts, draft_probs) -> torch.Tensor:
        """Rejection sampling of the unseeded requests ``raced``; returns their rows of
        [output tokens (k_max + 1, padded with -1), num_accepted], flattened."""
        k_max = max(len(drafts[i]) for i in raced)
        vocab_size = probs.shape[-1]
        if k_max == 0:  # no drafts: each row's token is its bonus, drawn as below without
            # rejection_sample's copies of the rows ([n, vocab] twice, ~1 ms at 32 rows)
            rows = probs if len(raced) == len(probs) else probs[[starts[i] for i in raced]]
            tokens = sample_rows(rows, final_uniforms(len(raced), self.device, self.generator))
            return torch.stack([tokens, torch.zeros_like(tokens)], dim=1).flatten()
        # [n, k_max + 1] row of probs for each (request, position); clamped padding
        index = [[starts[i] + min(j, len(drafts[i])) for j in range(k_max + 1)] for i in raced]
        target_probs = probs[torch.tensor(index, device=self.device)]
        padded = [drafts[i] + [0] * (k_max - len(drafts[i])) for i in raced]
        draft_ids = torch.tensor(padded, dtype=torch.long, device=self.device)
        q = None
        if any(items[i].request_id in draft_probs for i in raced):
            q = self._draft_distributions(raced, items, drafts, draft_probs, k_max, vocab_size)
        output, num_accepted = rejection_sample(
            target_probs,
            draft_ids,
            q,
            torch.tensor([len(drafts[i]) for i in raced], device=self.device),
            uniform_noise(len(raced), k_max, self.device, self.generator),
            None,
            final_uniforms(len(raced), self.device, self.generator),
        )
        return torch.cat([output, num_accepted.unsqueeze(1)], dim=1).flatten()

    def _draft_distributions(self, raced, items, drafts, draft_probs, k_max, vocab_size):
        """q for every raced row ([len(raced), k_max, vocab_size]): the draft model's
        distributions where it drafted, one-hot at each draft elsewhere (n-gram drafts
        are deterministic). A zero row would make ``u * q < p`` accept any draft with
        p > 0, so a row without a distribution of its own is never left at zero."""
        q = torch.zeros((len(raced), k_max, vocab_size), device=self.device)
        one_hot_rows, one_hot_positions, one_hot_tokens = [], [], []
        for row, i in enumerate(raced):
            rows = draft_probs.get(items[i].request_id)
            if rows is not None:
                q[row, : rows.shape[0]] = rows
            else:
                one_hot_rows += [row] * len(drafts[i])
                one_hot_positions += range(len(drafts[i]))
                one_hot_tokens += drafts[i]
        if one_hot_rows:
            index = torch.tensor(
                [one_hot_rows, one_hot_positions, one_hot_tokens], device=self.device
            )
            q[index[0], index[1], index[2]] = 1.0
        return q

    def _add_logprobs(self, result, logits, items, states, drafts, out_tokens, accepted):
        offset = 0
        for item, state, draft, tokens, nodes in zip(items, states, drafts, out_tokens, accepted):
            num_top = state.params.logprobs
            if num_top is not None:
                index = [offset + r for r in paths.accepted_rows(nodes)]
                rows = logits[torch.tensor(index, device=logits.device)]
                chosen, top_v, top_i = compute_logprobs(
                    rows, torch.tensor(tokens, device=self.device), num_top
                )
                result.logprobs[item.request_id] = [
                    TokenLogprob(t, lp, list(zip(ids, vals)))
                    for t, lp, ids, vals in zip(
                        tokens, chosen.tolist(), top_i.tolist(), top_v.tolist()
                    )
                ]
            offset += 1 + len(draft)


def _greedy_verify(logits: torch.Tensor, drafts: list[list[int]], parents):
    """All-greedy batches: coupling where every sample is the argmax, without building
    one-hot distributions."""
    argmax = row_argmax(logits).tolist()  # [sum(1 + drafts)], the only host sync
    out_tokens, accepted, offset = [], [], 0
    for draft, tree in zip(drafts, parents):
        tokens, nodes = paths.walk(draft, tree, argmax[offset : offset + len(draft) + 1])
        out_tokens.append(tokens)
        accepted.append(nodes)
        offset += len(draft) + 1
    return out_tokens, accepted
