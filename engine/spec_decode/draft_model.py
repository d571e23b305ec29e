"""Draft-model proposer: a small model with the target's tokenizer, its own paged KV
cache in its own block pool, run as a burst of k batched steps.

Draft cache bookkeeping per request (positions in the request's token sequence)::

    verified:  t_0 ............................................ t_{m-1}
    draft KV:  [0, num_computed)   num_computed <= m - 1, always
    burst:     step 1 feeds the catch-up t_{num_computed} .. t_{m-1}, then each later
               step feeds the draft sampled before it: d_1 .. d_{k-1}

The catch-up is the verified tokens the draft has not seen: the whole prompt on a
request's first burst, one token after a rejection, two after a full accept (d_k is
sampled but never fed), more after steps in which the request did not speculate. The
draft KV never covers the last verified token: its logits start the next burst. After
verification the draft KV is kept for the longest prefix of what it was fed that
matches the verified tokens; everything after is rolled back and its blocks return to
the draft pool at once. Catch-ups share the step's token budget
(``max_num_batched_tokens``); a request whose catch-up does not fit is fed a chunk of
it and proposes no drafts this step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from block_manager import KVCacheManager
from engine.config import EngineConfig
from engine.core.model_runner import ModelRunner, SeqInput
from engine.observability.stats import PoolStats
from engine.sample.grammar import mask_draft_logits
from engine.sample.logits_processor import LogitsAdjustment
from engine.sample.sampler import (
    SamplingBatch,
    expand_logits,
    processed_probs,
    sample_from_probs,
)
from scheduler.step_cost import DraftCostMeter, StepCostModel


def _num_params(loaded) -> int:
    return max(1, getattr(loaded.model, "num_streamed_params", loaded.model.num_params))


def check_same_vocabulary(target_loaded, draft_loaded) -> None:
    """Draft tokens are target tokens: the two vocabularies must be identical."""
    t_size, d_size = target_loaded.arch.vocab_size, draft_loaded.arch.vocab_size
    if t_size != d_size:
        raise ValueError(
            f"draft model vocabulary ({d_size} tokens) differs from the target's ({t_size}); "
            "the draft model must share the target's tokenizer"
        )
    if target_loaded.tokenizer.get_vocab() != draft_loaded.tokenizer.get_vocab():
        raise ValueError(
            "draft model tokenizer differs from the target's (same size, different tokens); "
            "the draft model must share the target's tokenizer"
        )


@dataclass(slots=True, eq=False)
class _DraftRequest:
    """Satisfies block_manager.CacheRequest; shares the target's verified token list."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    fed: list[int] = field(default_factory=list)  # tokens fed since num_computed_tokens
    fed_start: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, draft_loaded, target_loaded, num_blocks: int) -> None:
        check_same_vocabulary(target_loaded, draft_loaded)
        self.loaded = draft_loaded
        self.device = torch.device(draft_loaded.device)
        self.kv = KVCacheManager(
            num_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            cache_key=f"draft:{draft_loaded.name}:{draft_loaded.dtype}",
        )
        self.runner = ModelRunner(draft_loaded, num_blocks, config.block_size)
        # A trained draft scores only its draft vocabulary: its forwards return those
        # logits, expanded over the whole vocabulary only for rows that need q.
        self.vocab: torch.Tensor | None = getattr(draft_loaded.model, "draft_vocab", None)
        self.vocab_size = draft_loaded.arch.vocab_size
        if self.vocab is not None:
            self.runner.logits_fn = draft_loaded.model.compute_reduced_logits
        self.generator = torch.Generator(self.device).manual_seed(config.seed + 1)
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self._requests: dict[str, _DraftRequest] = {}
        # Proposing one draft token costs about one draft forward relative to a target
        # forward (both memory-bound at small batch); 0.02 covers the extra step
        # overhead. Verifying it is priced by the scheduler from measured steps.
        self.draft_cost = _num_params(draft_loaded) / _num_params(target_loaded) + 0.02
        # The prior above until the bursts have been timed: then measured, per batch size.
        self.cost_meter = DraftCostMeter(self.draft_cost)
        # The most verified tokens one request's draft caught up on in the last burst:
        # a whole prompt is the draft's prefill, which the speculation gate leaves out
        # as it leaves the target's prefill steps out.
        self.max_catchup = 0

    def update_cost(self, batch_size: int, target_cost: StepCostModel) -> float:
        """One draft token's cost in plain decode steps at ``batch_size`` requests, from
        this proposer's timed burst steps and the target's (adaptive k prices with it)."""
        self.draft_cost = self.cost_meter.cost(batch_size, target_cost)
        return self.draft_cost

    # ---- the burst ------------------------------------------------------------------
    def propose(self, items, states):
        """k batched draft steps over every speculating request."""
        drafts: list[list[int]] = [[] for _ in items]
        probs: list[list[torch.Tensor]] = [[] for _ in items]
        active: list[tuple[int, _DraftRequest, int]] = []  # (index, draft request, k)
        first: list[SeqInput] = []
        budget = self.max_num_batched_tokens
        self.max_catchup = 0
        for i, (item, state) in enumerate(zip(items, states)):
            dreq = self._draft_request(state.request)
            num_fed = self._reserve(dreq, item.num_spec_tokens, budget)
            if not num_fed:
                continue
            budget -= num_fed
            self.max_catchup = max(self.max_catchup, num_fed)
            whole = dreq.fed_start + num_fed == dreq.num_tokens
            block_ids = self.kv.get_block_ids(dreq.request_id)
            first.append(SeqInput(list(dreq.fed), dreq.fed_start, block_ids, int(whole)))
            if whole:
                active.append((i, dreq, item.num_spec_tokens))
        if first:
            logits = self.runner.forward(first)  # [len(active), vocab_size]
            self._burst(active, logits, states, drafts, probs)
        draft_probs = [torch.stack(p) if p else None for p in probs]
        return drafts, draft_probs

    def _burst(self, active, logits, states, drafts, probs) -> None:
        """The burst's sampling steps, shared by every draft that runs as a model:
        ``logits`` are the first forward's rows of ``active`` ((item index, draft request,
        k) each); a step samples one draft per active request, and the next forward
        (``_next_logits``) feeds them to those that want more."""
        step = 0
        rows = list(range(len(active)))  # each active request's row in the last forward
        started = time.perf_counter()  # a burst step: sampling, then the next forward
        # Greedy rows with nothing to process take the argmax of the draft's own logits
        # and keep no q: verification couples greedy rows (the target's argmax against
        # the draft), so q would go unread. Fixed per request, so a request has q for
        # all its drafts or none.
        by_argmax = [self._argmax_only(states[i]) for i, _, _ in active]
        while active:
            tokens: list[int | None] = [None] * len(active)
            fast = [r for r in range(len(active)) if by_argmax[r]]
            if fast:
                picked = logits[fast] if len(fast) < len(active) else logits
                idx = picked.argmax(dim=-1)
                ids = idx if self.vocab is None else self.vocab[idx]
                for r, token in zip(fast, ids.tolist()):
                    tokens[r] = token
            if len(fast) < len(active):
                dead = self._sample_rows(
                    logits, active, by_argmax, states, drafts, step, tokens, probs
                )
                if dead:  # the constraint allows nothing there: those requests stop drafting
                    live = [r for r in range(len(active)) if r not in dead]
                    active, rows = [active[r] for r in live], [rows[r] for r in live]
                    by_argmax = [by_argmax[r] for r in live]
                    tokens = [tokens[r] for r in live]
                    if not active:
                        break
            for (i, _, _), token in zip(active, tokens):
                drafts[i].append(token)
            step += 1
            # a request stops drafting at k, or at a stop token (nothing after it is kept)
            keep = [
                r
                for r, (i, _, k) in enumerate(active)
                if len(drafts[i]) < k and drafts[i][-1] not in states[i].request.stop_token_ids
            ]
            active, by_argmax = [active[r] for r in keep], [by_argmax[r] for r in keep]
            if active:
                logits = self._next_logits(active, [rows[r] for r in keep], drafts)
                rows = list(range(len(active)))
                now = time.perf_counter()
                self.cost_meter.observe(len(active), now - started)
                started = now

    @staticmethod
    def _argmax_only(state) -> bool:
        params = state.params
        return (params.is_greedy and not params.processes_logits
                and getattr(state, "grammar", None) is None)  # fmt: skip

    def _sample_rows(self, logits, active, by_argmax, states, drafts, step, tokens, probs):
        """Draw the drafts of the rows that need q (sampled, or with penalties or a
        constraint) into ``tokens`` and their q into ``probs``; returns the rows (of
        ``active``) whose constraint allows nothing."""
        slow = [r for r in range(len(active)) if not by_argmax[r]]
        sub = [active[r] for r in slow]
        picked = logits[slow] if len(slow) < len(active) else logits
        if self.vocab is not None:
            picked = expand_logits(picked, self.vocab, self.vocab_size)
        # Processed as the verifier processes this position (penalties counting the
        # drafts before it, then the constraint's mask), so a draft model that agrees
        # with the target proposes what the target would sample
        picked = self._adjusted(picked, sub, states, drafts)
        dead = set(self._masked(picked, sub, states, drafts))
        live = [n for n in range(len(sub)) if n not in dead]
        if live:
            if dead:
                picked = picked[live]
            sub = [sub[n] for n in live]
            # d_{step+1} goes to position num_tokens + step: the noise the verifier
            # samples that position with, so seeded requests are verified by coupling
            batch = SamplingBatch.build(
                [states[i].params for i, _, _ in sub],
                [states[i].request.num_tokens + step for i, _, _ in sub],
                self.device,
            )
            q = processed_probs(picked, batch)
            for n, token in enumerate(sample_from_probs(q, batch, self.generator).tolist()):
                r = slow[live[n]]
                tokens[r] = token
                probs[active[r][0]].append(q[n])
        return [slow[n] for n in sorted(dead)]

    def _next_logits(self, active, rows, drafts) -> torch.Tensor:
        """The next burst step: feed each active request its last draft (``rows``: its
        row in the step before, for drafts that read the model's own outputs)."""
        return self.runner.forward([self._feed(d, drafts[i][-1]) for i, d, _ in active])

    def _masked(self, logits, active, states, drafts) -> list[int]:
        """Constrained requests' rows under their constraint's mask after their drafts
        so far (in place); returns the rows it allows nothing in. A draft drawn under the
        mask is one verification can accept: unmasked, the first refused draft would end
        the run (structured.constrain cuts there)."""
        rows = [
            (row, states[i].grammar, drafts[i], states[i].params.is_greedy)
            for row, (i, _, _) in enumerate(active)
            if getattr(states[i], "grammar", None) is not None
        ]
        return mask_draft_logits(logits, rows) if rows else []

    def _adjusted(self, logits, active, states, drafts) -> torch.Tensor:
        """logits [len(active), vocab_size] under each request's penalties, logit bias
        and min_tokens, with its drafts so far counted as generated."""
        if not any(states[i].params.processes_logits for i, _, _ in active):
            return logits
        adjustment = LogitsAdjustment.build(
            [states[i].request for i, _, _ in active],
            [states[i].params for i, _, _ in active],
            [drafts[i] for i, _, _ in active],
            [1] * len(active),
            logits.shape[-1],
            self.device,
        )
        return logits if adjustment is None else adjustment.apply(logits, in_place=True)

    def _draft_request(self, request) -> _DraftRequest:
        dreq = self._requests.get(request.request_id)
        if dreq is None:
            # Shares the request's token list, which only grows (or is cut at a stop).
            dreq = _DraftRequest(request.request_id, request.all_token_ids)
            self._requests[request.request_id] = dreq
        return dreq

    def _reserve(self, dreq: _DraftRequest, k: int, budget: int) -> int:
        """Blocks for this step's catch-up, at most ``budget`` tokens, plus k - 1 fed
        drafts when the whole catch-up fits. Returns the catch-up tokens to feed (0:
        nothing fits, or the pool is full)."""
        if budget <= 0:
            return 0
        cached_ids, num_cached = [], 0
        if dreq.num_computed_tokens == 0 and not self.kv.get_block_ids(dreq.request_id):
            cached_ids, num_cached = self.kv.get_computed_blocks(dreq)
        num_fed = min(dreq.num_tokens - dreq.num_computed_tokens - num_cached, budget)
        whole = dreq.num_computed_tokens + num_cached + num_fed == dreq.num_tokens
        if self.kv.allocate_slots(dreq, num_fed, k - 1 if whole else 0, cached_ids) is None:
            return 0
        dreq.num_computed_tokens += num_cached
        dreq.fed_start = dreq.num_computed_tokens
        dreq.fed = dreq.all_token_ids[dreq.fed_start : dreq.fed_start + num_fed]
        return num_fed

    def _feed(self, dreq: _DraftRequest, token: int) -> SeqInput:
        """Input for a later burst step: the draft sampled by the step before."""
        dreq.fed.append(token)
        position = dreq.fed_start + len(dreq.fed) - 1
        return SeqInput([token], position, self.kv.get_block_ids(dreq.request_id), 1)

    # ---- after verification ---------------------------------------------------------
    def on_verified(self, requests) -> None:
        for request in requests:
            dreq = self._requests.get(request.request_id)
            if dreq is None or not dreq.fed:
                continue
            verified = request.all_token_ids
            matched = 0
            for offset, token in enumerate(dreq.fed):
                position = dreq.fed_start + offset
                if position >= len(verified) or verified[position] != token:
                    break
                matched += 1
            # Even when every fed token was verified (a recovered token equal to the
            # rejected draft), the last verified token is fed again: its logits start
            # the next burst.
            num_valid = min(dreq.fed_start + matched, len(verified) - 1)
            dreq.num_computed_tokens = self.kv.rollback(dreq, num_valid)
            dreq.fed = []

    def free(self, request_id: str) -> None:
        dreq = self._requests.pop(request_id, None)
        if dreq is not None:
            self.kv.free(dreq)

    def pool_stats(self) -> PoolStats:
        kv = self.kv
        return PoolStats(
            num_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            num_blocks_in_use=kv.num_blocks - kv.num_free_blocks,
            usage=kv.usage,
            num_blocks_freed_by_rollback=kv.num_blocks_freed_by_rollback,
        )
