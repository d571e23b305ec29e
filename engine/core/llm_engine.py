"""LLMEngine: schedule -> propose -> one packed forward -> sample/verify -> update -> emit."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import torch

from block_manager import KVCacheManager, KVEventRecorder
from engine.config import EngineConfig
from engine.core import structured
from engine.core.kv_sizing import plan_kv_cache
from engine.core.model_runner import ModelRunner, SeqInput
from engine.io.detokenizer import IncrementalDetokenizer
from engine.io.input_processor import InputProcessor
from engine.io.outputs import RequestMetrics, RequestOutput
from engine.io.sampling_params import SamplingParams
from engine.observability.stats import EngineStats, StepRecord, StepTimings
from engine.sample.grammar import Grammar, GrammarCompiler, GrammarLimits
from engine.sample.sampler import nonfinite_rows
from engine.spec_decode import paths
from engine.spec_decode.proposers import build_proposer
from engine.spec_decode.trained_draft import load_draft
from engine.spec_decode.verifier import Verifier
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request
from scheduler.scheduler import FORCED, Scheduler, SchedulerConfig
from scheduler.spec_gate import SpeculationGate, step_lane

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _RequestState:
    """Engine-side state of a request: what the scheduler must not see."""

    request: Request
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    client_request_id: str  # the caller's label; request_id is the engine's key
    num_emitted_tokens: int = 0
    grammar: Grammar | None = None  # the output constraint's matcher, if any
    # Why the engine ended the request with finish_reason "error" where the caller's
    # input is not at fault (the model's logits were not finite), or None.
    model_failure: str | None = None


def _quarantine_nonfinite(logits: torch.Tensor, states: list, drafts: list) -> dict:
    """The requests with verified rows that hold a NaN or +Inf logit (-Inf alone is a
    token of probability 0, not an error), by id: (state, output tokens before the step,
    the bad rows, 0 = the first verified row). Their bad rows are zeroed so the sampler
    runs on numbers; whether what it drew from them is kept is decided after the step
    (``_end_model_failures``). Unchecked, a NaN row turns into a plausible token: argmax
    and the samplers take NaN for a value. On the CPU one pass of the compiled kernels
    over the logits (sampler.nonfinite_rows)."""
    bad_rows = nonfinite_rows(logits)
    if not bad_rows:
        return {}
    with torch.inference_mode():  # the logits are inference tensors: zeroed in place
        bad = set(bad_rows)
        broken, row = {}, 0
        for state, request_drafts in zip(states, drafts, strict=True):
            end = row + 1 + len(request_drafts)
            rows = [r - row for r in range(row, end) if r in bad]
            if rows:
                logits[row:end][rows] = 0.0
                request = state.request
                broken[request.request_id] = (state, request.num_output_tokens, rows)
            row = end
    return broken


def _detokenize(state: _RequestState, new_ids: list[int]) -> tuple[str, str | None, list[int]]:
    """(text to emit, the stop string hit or None, the tokens up to the one that completed
    it). Tokens go in one at a time, as plain decoding pushes them, so the text and where
    a stop string ends depend on the tokens alone, not on how many drafts a step kept."""
    texts = []
    # As with stop tokens, the first min_tokens output tokens cannot end the request
    # with a stop string (vLLM's rule).
    num_before, min_tokens = state.num_emitted_tokens, state.params.min_tokens
    for i, token_id in enumerate(new_ids):
        text, stop_hit = state.detokenizer.push([token_id], num_before + i >= min_tokens)
        texts.append(text)
        if stop_hit is not None:
            return "".join(texts), stop_hit, new_ids[: i + 1]
    return "".join(texts), None, new_ids


def resolve_spec_disable_batch_size(value: int | None, device: torch.device) -> int:
    """The configured value, or the device's default (see EngineConfig)."""
    if value is not None:
        return value
    return 16 if device.type == "cuda" else 4


def _prefix_cache_key(loaded, kv_cache_dtype: torch.dtype) -> str:
    """What a prefix-cache hash is salted with: the model, its dtype and, when it is
    another, the KV cache's dtype (a bf16 cache holds other values than an fp32 one)."""
    key = f"{loaded.name}:{loaded.dtype}"
    return key if kv_cache_dtype is loaded.dtype else f"{key}:kv-{kv_cache_dtype}"


def _apply_batch_invariance(batch_invariant: bool) -> None:
    """The quantized Linear's rule for bf16 tiles, process-wide: never (every call on
    the int8 paths, the same bits at any row count), or by format where the kernels
    have the path (docs/architecture.md, "Quantized weights")."""
    from engine.kernels.quant import quant_ops

    ops = quant_ops()
    if ops is not None:
        ops.set_bf16_min_rows(0 if batch_invariant else -1)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded=None, draft_loaded=None) -> None:
        from engine.loader import load_model, resolve_kv_cache_dtype

        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.loaded = loaded or load_model(
            config.model,
            dtype=config.dtype,
            device=config.device,
            attn_backend=config.attn_backend,
            tokenizer=config.tokenizer,
            quantization=config.quantization,
        )
        self.tokenizer = self.loaded.tokenizer
        self.device = torch.device(self.loaded.device)
        if self.device.type == "cpu":
            _apply_batch_invariance(config.batch_invariant)
        method = config.resolved_speculative_method
        if method in ("draft", "hybrid", "eagle", "eagle-tree") and draft_loaded is None:
            draft_loaded = load_draft(
                config.resolved_draft_model, self.loaded, config.attn_backend, config.quantization
            )
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.loaded.dtype)
        plan = plan_kv_cache(config, self.loaded, draft_loaded)
        self.max_model_len = plan.max_model_len
        self.num_kv_blocks = plan.num_blocks
        # The target pool's prefix-cache events (the draft pool publishes none); off
        # until a consumer that drains them after every step turns them on.
        self.kv_events = KVEventRecorder()
        self.kv_manager = KVCacheManager(
            plan.num_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            cache_key=_prefix_cache_key(self.loaded, self.kv_cache_dtype),
            event_sink=self.kv_events,
        )
        self.runner = ModelRunner(
            self.loaded, plan.num_blocks, config.block_size, self.kv_cache_dtype
        )
        # An EAGLE proposer turns the target's feature capture on; a target shared with
        # an earlier engine (benchmarks run several on one loaded model) starts without.
        self.loaded.model.model.capture_layers = ()
        self.proposer = build_proposer(method, config, self.loaded, draft_loaded, plan.num_blocks)
        self._feature_sink = getattr(self.proposer, "on_target_forward", None)
        self._update_cost = getattr(self.proposer, "update_cost", None)
        self.eos_token_ids = frozenset(self.loaded.eos_token_ids)
        self.verifier = Verifier(self.device, config.seed, min(self.eos_token_ids, default=0))
        self.vocab_size = self.loaded.arch.vocab_size
        # Structured output: constraints compiled once per tokenizer, masks beside the
        # forward (engine/core/structured.py).
        limits = GrammarLimits(
            config.structured_output_step_budget_ms, config.structured_output_max_items
        )
        self.grammars = GrammarCompiler(
            self.tokenizer, self.vocab_size, self.eos_token_ids, limits=limits
        )
        self._masks = structured.MaskBuilder()
        self._num_constrained = 0
        # Constrained requests' n-gram drafts get the tokens the constraint forces after
        # them appended (deterministic drafts only: a draft model's have q rows).
        self._forced_tail = method in ("ngram", "suffix", "hybrid")
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                num_spec_tokens=config.num_speculative_tokens,
                spec_enabled=self.proposer is not None,
                spec_disable_batch_size=resolve_spec_disable_batch_size(
                    config.speculative_disable_batch_size, self.device
                ),
                draft_cost=self.proposer.draft_cost if self.proposer else 0.0,
                spec_tree_max_nodes=config.spec_tree_max_nodes,
            ),
            self.kv_manager,
        )
        if self.proposer is not None and config.speculation_gate:
            self.scheduler.gate = SpeculationGate()
        self.scheduler.tree_sources = frozenset(getattr(self.proposer, "tree_sources", ()))
        source_for = getattr(self.proposer, "source_for", None)
        if source_for is not None:  # k from the history of the source it picks, gated per source
            max_k = config.num_speculative_tokens
            self.scheduler.spec_source = lambda request: source_for(request, max_k)
        max_spec_tokens = config.num_speculative_tokens if self.proposer is not None else 0
        self.input_processor = InputProcessor(
            self.tokenizer, self.vocab_size, self.max_model_len, max_spec_tokens
        )
        self._states: dict[str, _RequestState] = {}
        self.stats = EngineStats()
        self.last_step: StepRecord | None = None

    # ---- requests ---------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        messages: list[dict[str, str]] | None = None,
        arrival_time: float | None = None,
        client_request_id: str | None = None,
        grammar: Grammar | None = None,
        cache_scope: str | None = None,
    ) -> None:
        """Queue a request. Raises ValueError (naming the field) for bad input.

        ``request_id`` must be unique among the engine's unfinished requests: it is how
        outputs and aborts find the request. ``client_request_id`` (default: the
        request_id) is a label only, carried into every RequestOutput for logs and
        replies; any number of requests may share it. ``grammar``: the request's
        constraint compiled already (``self.grammars.grammar``, off this thread); else a
        ``structured_output`` is compiled here.
        """
        params = params or SamplingParams()
        prompt_ids = self.input_processor.prompt_token_ids(prompt, messages, params)
        if request_id in self._states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.structured_output is not None and grammar is None:
            grammar = self.grammars.grammar(params.structured_output)
        stop_ids = set(params.stop_token_ids)
        # A constraint ends at EOS (the only token it allows once complete), ignore_eos or not.
        if not params.ignore_eos or grammar is not None:
            stop_ids |= self.eos_token_ids
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            max_tokens=params.max_tokens,
            stop_token_ids=frozenset(stop_ids),
            priority=priority,
            arrival_time=arrival_time or time.monotonic(),
            max_spec_tokens=params.num_speculative_tokens,
            sampling_params=params,
        )
        self._states[request_id] = _RequestState(
            request=request,
            params=params,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output
            ),
            metrics=RequestMetrics(
                arrival_time=request.arrival_time, num_prompt_tokens=len(prompt_ids)
            ),
            client_request_id=request_id if client_request_id is None else client_request_id,
            grammar=grammar,
        )
        # Whose recent answers suffix decoding may propose from: the caller's own
        # (its API key's id), since acceptance speed could reveal another's text.
        request.cache_scope = cache_scope
        if grammar is not None and self._forced_tail:
            request.forced_tail_slots = structured.FORCED_TAIL_SLOTS
        self._num_constrained += grammar is not None
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self._states.get(request_id)
        if state is None:
            return None
        self.scheduler.abort(request_id)
        return self._finish_output(state, [], "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_waiting_requests(self) -> int:
        return self.scheduler.num_waiting

    # ---- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        forced = structured.forced_counts(self._states.values()) if self._num_constrained else {}
        if self._update_cost is not None:  # a draft model's cost at this batch, measured
            scheduler = self.scheduler
            scheduler.draft_cost = self._update_cost(len(scheduler.running), scheduler.cost_model)
        sched = self.scheduler.schedule()
        self._release_preempted(sched)
        if sched.is_empty:
            return []
        t1 = time.perf_counter()
        draft_probs = self._propose(sched)
        if self._num_constrained:
            structured.constrain(sched, self._states, forced, draft_probs)
        t2 = time.perf_counter()
        seqs, sample_states, drafts, trees = self._build_inputs(sched)
        prepared = self.runner.prepare(seqs)
        t3 = time.perf_counter()
        pending = self._masks.start(sample_states, drafts, trees) if self._num_constrained else None
        logits = self.runner.execute(prepared)  # [sum(1 + drafts) of sampling requests, vocab]
        if self._feature_sink is not None:  # an EAGLE draft keeps the target's features
            self._feature_sink(sched.scheduled, seqs)
        masks = pending.result() if pending is not None else None
        broken = _quarantine_nonfinite(logits, sample_states, drafts)
        runner_output = self.verifier.verify(
            logits, sched, sample_states, drafts, draft_probs, masks, trees
        )
        if runner_output.accepted_nodes:
            self._move_accepted_kv(sched, runner_output.accepted_nodes)
        t4 = time.perf_counter()
        changed = self.scheduler.update(sched, runner_output)
        if self._num_constrained:
            structured.advance(changed, self._states)
        if self.proposer is not None:
            self.proposer.on_verified(changed)
        if self._num_constrained:
            changed += self._end_failed_constraints(changed)
        if broken:
            changed += self._end_model_failures(broken, changed, runner_output)
        outputs = [self._emit(self._states[r.request_id], runner_output) for r in changed]
        timings = StepTimings(
            schedule_s=t1 - t0,
            draft_s=t2 - t1,
            prepare_s=t3 - t2,
            forward_s=t4 - t3,
            update_s=time.perf_counter() - t4,
        )
        # every request fed its one last token (and its drafts): no prefill chunk, no
        # catch-up (a short prompt's prefill must not pass for a plain decode step, in
        # the cost model or in the gate)
        decode_only = all(
            s.num_scheduled_tokens - len(s.spec_token_ids) == 1 for s in sched.scheduled
        )
        if decode_only:
            # decode / verification steps only: prefill chunks run GEMMs at another
            # efficiency and would bend the per-token slope adaptive k depends on
            self.scheduler.cost_model.observe(
                prepared.metadata.num_tokens,
                timings.draft_s + timings.prepare_s + timings.forward_s,
            )
        self._record_step(sched, timings, runner_output)
        if self.scheduler.gate is not None and decode_only and not forced:
            self._observe_gate(sched, runner_output, time.perf_counter() - t0)
        return [o for o in outputs if o is not None]

    def _end_failed_constraints(self, changed: list[Request]) -> list[Request]:
        """End every request whose constraint failed this step (finish_reason "error",
        the failure as its finish_detail), its output cut back to the last token its
        matcher took: what came after was not checked by the constraint. Its blocks go
        back to the pool; no other request sees anything of it. Returns those of them
        not in ``changed``, which must still emit their last output."""
        seen = {r.request_id for r in changed}
        extra = []
        for state in structured.failed(self._states.values()):
            request = state.request
            del request.all_token_ids[request.num_prompt_tokens + state.grammar.num_consumed :]
            request.finish_reason, request.stop_reason = "error", None
            self.scheduler.finish(request, "error")
            if request.request_id not in seen:
                extra.append(request)
        return extra

    def _end_model_failures(
        self, broken: dict, changed: list[Request], runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """End each request that kept a token drawn from a non-finite row this step
        (finish_reason "error", why as its finish_detail), its output cut back to what
        it had before the step. A bad row the verification never reached (after a
        rejected draft, on a branch of a tree it did not take) is what plain decoding
        would never have computed: that request goes on as if it were not there.
        Returns the ended requests not in ``changed``."""
        seen = {r.request_id for r in changed}
        extra = []
        for request_id, (state, num_output, bad_rows) in broken.items():
            request = state.request
            if request.is_finished and request.finish_reason == "error":
                continue  # its constraint failed in the same step: that ended it
            kept = request.num_output_tokens - num_output
            nodes = runner_output.accepted_nodes.get(request_id)
            # the row each kept token was drawn from: a chain's in order, a tree's
            # along the accepted path
            used = [0, *(1 + n for n in nodes)] if nodes else list(range(kept))
            if not set(used[:kept]) & set(bad_rows):
                continue
            del request.all_token_ids[request.num_prompt_tokens + num_output :]
            state.model_failure = (
                f"the model's logits were not finite (NaN or +Inf) at output token "
                f"{num_output}; nothing was sampled from them"
            )
            request.finish_reason, request.stop_reason = "error", None
            self.scheduler.finish(request, "error")
            logger.error("request %s: %s", state.client_request_id, state.model_failure)
            if request_id not in seen:
                extra.append(request)
        return extra

    def _observe_gate(self, sched: SchedulerOutput, runner_output, seconds: float) -> None:
        """A decode step's outcome for the speculation gate; a draft's prefill (a new
        request's prompt) is left out as the target's prefill steps are."""
        lanes = {s.spec_source for s in sched.scheduled if s.num_proposed}
        catchup = getattr(self.proposer, "max_catchup", 0)
        if lanes and catchup > 1 + self.config.num_speculative_tokens:
            return
        self.scheduler.gate.observe(
            len(sched.scheduled),
            bool(lanes),
            sum(len(t) for t in runner_output.sampled_token_ids.values()),
            seconds,
            lane=step_lane(lanes),
        )

    def _release_preempted(self, sched: SchedulerOutput) -> None:
        if self.proposer is not None:
            for request_id in sched.preempted_request_ids:
                self.proposer.free(request_id)

    def _propose(self, sched: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Fill each speculating request's drafts; returns the draft model's
        distributions by request id ([num_drafts, vocab_size]; none for n-gram drafts)."""
        # A constraint's forced tokens need no proposer: structured.constrain fills them.
        speculating = [
            s for s in sched.scheduled if s.num_spec_tokens > 0 and s.spec_source != FORCED
        ]
        if not speculating or self.proposer is None:
            return {}
        requests = [self._states[s.request_id] for s in speculating]
        drafts, draft_probs = self.proposer.propose(speculating, requests)
        for item, proposal in zip(speculating, drafts):
            # A proposal is a chain (a list of tokens) or a token tree (DraftTree).
            parents = getattr(proposal, "parents", None)
            tokens = list(proposal.tokens) if parents is not None else proposal
            item.spec_token_ids = tokens
            item.spec_parents = None if paths.is_chain(parents) else list(parents)
            item.num_scheduled_tokens += len(tokens)
        if draft_probs is None:
            return {}
        return {
            item.request_id: probs
            for item, probs in zip(speculating, draft_probs)
            if probs is not None
        }

    def _build_inputs(self, sched: SchedulerOutput):
        seqs: list[SeqInput] = []
        sample_states: list[_RequestState] = []
        drafts: list[list[int]] = []
        trees: list[list[int] | None] = []
        for item in sched.scheduled:
            state = self._states[item.request_id]
            request = state.request
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = request.first_scheduled_time
            num_drafts = len(item.spec_token_ids)
            num_verified = item.num_scheduled_tokens - num_drafts
            start = item.num_computed_tokens
            tokens = request.all_token_ids[start : start + num_verified] + item.spec_token_ids
            num_logits = 1 + num_drafts if item.needs_sample else 0
            seq = SeqInput(tokens, start, item.block_ids, num_logits)
            parents = item.spec_parents
            if parents is not None:
                # A token tree: its nodes take the next slots in order, each at the
                # position of its depth below the root (the last verified token) and
                # seeing only its ancestors among them.
                root = start + num_verified - 1
                depth = paths.depths(parents, num_drafts)
                seq.positions = [*range(start, root + 1), *(root + d for d in depth)]
                seq.tree_mask = paths.ancestor_masks(parents, num_verified, num_drafts)
            seqs.append(seq)
            if item.needs_sample:
                sample_states.append(state)
                drafts.append(item.spec_token_ids)
                trees.append(parents)
        return seqs, sample_states, drafts, trees

    def _move_accepted_kv(self, sched: SchedulerOutput, accepted: dict[str, list[int]]) -> None:
        """A token tree's accepted path, node ``i_k`` at depth ``k + 1``, wrote its KV to
        the slot of node ``i_k``; it moves to the slot of depth ``k + 1``, where plain
        decoding would have put it (the rollback after the update frees the rest)."""
        bs = self.config.block_size
        src, dst = [], []
        for item in sched.scheduled:
            nodes = accepted.get(item.request_id)
            if not nodes:
                continue
            base = item.num_scheduled_tokens - len(item.spec_token_ids)
            base += item.num_computed_tokens  # the position of node 0's slot
            table = item.block_ids
            for k, node in enumerate(nodes):
                if node != k:
                    a, b = base + node, base + k
                    src.append(table[a // bs] * bs + a % bs)
                    dst.append(table[b // bs] * bs + b % bs)
        if src:
            self.runner.move_kv(src, dst)
        move_features = getattr(self.proposer, "on_accepted_nodes", None)
        if move_features is not None:  # an EAGLE draft's features move with the KV
            for item in sched.scheduled:
                nodes = accepted.get(item.request_id)
                if nodes:
                    base = item.num_computed_tokens + item.num_scheduled_tokens
                    move_features(item.request_id, base - len(item.spec_token_ids), nodes)

    # ---- outputs ----------------------------------------------------------------------
    def _emit(self, state: _RequestState, runner_output: ModelRunnerOutput) -> RequestOutput | None:
        request = state.request
        new_ids = request.output_token_ids[state.num_emitted_tokens :]
        text, stop_hit, kept_ids = _detokenize(state, new_ids)
        if len(kept_ids) < len(new_ids):
            # The stop string ended inside this step's tokens (accepted drafts): drop the
            # tokens after it as if never sampled, so token ids, usage and logprobs
            # match the same request without speculation; the stop string came first.
            del request.all_token_ids[len(kept_ids) - len(new_ids) :]
            new_ids = kept_ids
            request.finish_reason = request.stop_reason = None
        state.num_emitted_tokens = request.num_output_tokens
        self.stats.num_generation_tokens += len(new_ids)
        now = time.monotonic()
        if state.metrics.first_token_time is None and new_ids:
            state.metrics.first_token_time = now
            self.stats.num_prompt_tokens += request.num_prompt_tokens
        logprobs = runner_output.logprobs.get(request.request_id)
        if stop_hit is not None and request.finish_reason is None:
            request.stop_reason = stop_hit
            request.finish_reason = "stop"
            self.scheduler.finish(request, "stop")
        if request.is_finished:
            if stop_hit is None:
                text += state.detokenizer.flush()
            return self._finish_output(state, new_ids, text, logprobs)
        if not new_ids:
            return None
        return self._output(state, new_ids, text, False, None, logprobs)

    def _finish_output(self, state, new_ids, text, logprobs=None) -> RequestOutput:
        request = state.request
        if not request.is_finished:  # aborted before the scheduler saw it finish
            request.finish_reason = request.finish_reason or "abort"
        if self._states.pop(request.request_id, None) is not None and state.grammar is not None:
            self._num_constrained -= 1
        if self.proposer is not None:
            self.proposer.free(request.request_id)
        metrics = state.metrics
        metrics.finished_time = time.monotonic()
        metrics.num_cached_prompt_tokens = request.num_cached_prompt_tokens
        metrics.num_draft_tokens = request.num_draft_tokens
        metrics.num_accepted_tokens = request.num_accepted_tokens
        metrics.num_preemptions = request.num_preemptions
        self.stats.num_requests_finished[request.finish_reason] += 1
        return self._output(state, new_ids, text, True, request.finish_reason, logprobs)

    def _output(self, state, new_ids, text, finished, reason, logprobs) -> RequestOutput:
        request = state.request
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(new_ids),
            text=text,
            finished=finished,
            finish_reason=reason,
            metrics=state.metrics,
            stop_reason=request.stop_reason if finished else None,
            logprobs=logprobs[: len(new_ids)] if logprobs else None,
            client_request_id=state.client_request_id,
            finish_detail=(state.model_failure or structured.finish_detail(state))
            if finished
            else None,
            error=state.model_failure if finished else None,
        )

    def _record_step(
        self,
        sched: SchedulerOutput,
        timings: StepTimings,
        runner_output: ModelRunnerOutput,
    ) -> None:
        stats = self.stats
        stats.num_steps += 1
        stats.num_preemptions = self.scheduler.num_preemptions
        stats.num_gated_steps = self.scheduler.num_gated_steps
        verified = [s for s in sched.scheduled if s.num_proposed and s.spec_source != FORCED]
        for item in verified:  # a constraint's forced tokens are not drafts
            stats.num_draft_tokens += item.num_proposed
            accepted = runner_output.num_accepted[item.request_id]
            stats.num_accepted_tokens += min(accepted, item.num_proposed)
        self.refresh_stats()
        stats.mean_speculative_length = (
            sum(s.num_proposed for s in verified) / len(verified) if verified else 0.0
        )
        self.last_step = StepRecord(
            batch_size=len(sched.scheduled),
            num_batched_tokens=sum(s.num_scheduled_tokens for s in sched.scheduled),
            draft_time_s=timings.draft_s,
            forward_time_s=timings.forward_s,
            timings=timings,
            drafts_per_verification=[s.num_proposed for s in verified],
            accepted_per_verification=[
                min(runner_output.num_accepted[s.request_id], s.num_proposed) for s in verified
            ],
        )

    def refresh_stats(self) -> None:
        """Publish queue and KV pool state into self.stats (also after an abort)."""
        self.stats.num_running = self.scheduler.num_running
        self.stats.num_waiting = self.scheduler.num_waiting
        kv = self.kv_manager
        pool = self.stats.target_pool
        pool.num_blocks = kv.num_blocks
        pool.num_free_blocks = kv.num_free_blocks
        pool.num_blocks_in_use = kv.num_blocks - kv.num_free_blocks
        pool.usage = kv.usage
        pool.num_blocks_freed_by_rollback = kv.num_blocks_freed_by_rollback
        self.stats.num_prefix_query_tokens = kv.num_prefix_query_tokens
        self.stats.num_prefix_hit_tokens = kv.num_prefix_hit_tokens
        if self.proposer is not None:
            self.stats.draft_pool = self.proposer.pool_stats()

    def model_info(self) -> dict:
        return {
            "model": self.loaded.name,
            "draft_model": self.config.resolved_draft_model or "",
            "speculative_method": self.config.resolved_speculative_method,
            "num_speculative_tokens": self.config.num_speculative_tokens,
            "block_size": self.config.block_size,
            "max_model_len": self.max_model_len,
            "vocab_size": self.vocab_size,
            "max_num_seqs": self.config.max_num_seqs,
            "max_waiting_requests": self.config.max_waiting_requests,
            "num_kv_blocks": self.num_kv_blocks,
            "eos_token_ids": sorted(self.eos_token_ids),
            "device": str(self.device),
            "dtype": str(self.loaded.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(self.kv_cache_dtype).removeprefix("torch."),
            "attn_backend": self.loaded.model.model.layers[0].self_attn.attn_backend.name,
            "quantization": self.loaded.quantization,
            "architectures": list(self.loaded.arch.architectures),
            "model_type": _hf_model_type(self.loaded.model_dir),
            "bos_token_id": self.loaded.arch.bos_token_id,
            "pad_token_id": getattr(self.tokenizer, "pad_token_id", None),
            "model_dir": str(self.loaded.model_dir or ""),
            "tokenizer_dir": self.config.tokenizer or str(self.loaded.model_dir or ""),
            "enable_prefix_caching": self.config.enable_prefix_caching,
        }


def _hf_model_type(model_dir) -> str:
    """The ``model_type`` of the HF config the weights came from ("" when unreadable)."""
    try:
        return str(json.loads((model_dir / "config.json").read_text()).get("model_type") or "")
    except (OSError, TypeError, ValueError, AttributeError):
        return ""
