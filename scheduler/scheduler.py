"""Continuous batching with one rule.

Each step every scheduled request gets enough tokens that ``num_computed_tokens``
catches up with ``num_tokens + num_spec_tokens``. That single rule is prefill (many
tokens), chunked prefill (a budget-limited slice), a prefix-cache hit (the cached part
counts as computed), decode (one token) and verification (one token plus k drafts).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from block_manager import KVCacheManager
from scheduler.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.spec_gate import SpeculationGate
from scheduler.spec_length import choose_num_spec_tokens
from scheduler.step_cost import StepCostModel

# The spec_source of a step whose drafts are a constraint's forced tokens.
FORCED = "forced"
# A token tree's nodes and its root fit one 64-bit attention mask per fed token.
MAX_TREE_NODES = 63


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    # Speculation: 0 disables it. Above `spec_disable_batch_size` running requests
    # nobody speculates. `draft_cost` is the cost of proposing one draft token, in
    # target steps; verifying it is priced by the scheduler's StepCostModel (measured),
    # or by `default_verify_cost` until that has seen enough steps.
    num_spec_tokens: int = 0
    spec_disable_batch_size: int = 16
    draft_cost: float = 0.05
    default_verify_cost: float = 0.04
    # False when the engine has no proposer: nobody speculates, whatever they ask.
    spec_enabled: bool = False
    # Lookahead slots a request of a token-tree lane gets when it speculates: the most
    # nodes its proposer may verify (it prices how many it uses). 0: no trees.
    spec_tree_max_nodes: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        # Fed by the engine with each forward's token count and time (adaptive k).
        self.cost_model = StepCostModel()
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []  # kept sorted by Request.sort_key
        # Heap of waiting and preempted requests; a finished request leaves it at once.
        self._waiting: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()
        self.num_preemptions = 0
        # Set by the engine for a proposer that combines several: request -> (the
        # proposer it will use, that proposer's draft cost).
        self.spec_source: Callable[[Request], tuple[str, float]] | None = None
        # One draft token's proposing cost in plain decode steps, set by the engine
        # before each schedule from the proposer's measured bursts (the config's until then).
        self.draft_cost = config.draft_cost
        # Set by the engine (EngineConfig.speculation_gate): whether adaptive k may
        # speculate this step at all, from measured step throughput.
        self.gate: SpeculationGate | None = None
        # Steps where the gate held at k = 0 a request that would have chosen k
        # adaptively (not steps where every request had its own fixed k).
        self.num_gated_steps = 0
        self._held = False  # this step held one back
        self._lanes: dict[str | None, bool] = {}  # the gate's answer per lane, this step
        # Set by the engine: the proposer's lanes that draft token trees (their requests
        # get spec_tree_max_nodes slots when adaptive k would speculate at all).
        self.tree_sources: frozenset[str] = frozenset()

    # ---- queue management ----------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self._waiting)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._push_waiting(request)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request wherever it is; its blocks return to the pool at once."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish(request, "abort")
        return request

    def finish(self, request: Request, reason: str) -> None:
        if request.status is RequestStatus.FINISHED:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self._remove_waiting(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = request.finish_reason or reason
        self.kv.free(request)
        self.requests.pop(request.request_id, None)

    def _push_waiting(self, request: Request) -> None:
        heapq.heappush(
            self._waiting, (request.priority, request.arrival_time, next(self._tiebreak), request)
        )

    def _remove_waiting(self, request: Request) -> None:
        # O(waiting) per abort, against lazy deletion's dead entries that an idle
        # scheduler would keep (with their prompts) until the next admission.
        self._waiting = [entry for entry in self._waiting if entry[3] is not request]
        heapq.heapify(self._waiting)

    def _peek_waiting(self) -> Request | None:
        return self._waiting[0][3] if self._waiting else None

    # ---- schedule ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        speculate = (
            self.config.spec_enabled and len(self.running) <= self.config.spec_disable_batch_size
        )
        spec_cost = self._spec_cost() if speculate else 0.0
        adaptive = speculate and (self.gate is None or self.gate.begin_step(len(self.running)))
        self._held = False
        self._lanes.clear()
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            tail = 0
            if request.num_forced_tokens:
                num_spec, source = self._num_forced_tokens(request), FORCED
            elif speculate:
                num_spec, source = self._num_spec_tokens(request, spec_cost, adaptive)
                if num_spec and source in self.tree_sources:
                    num_spec = max(num_spec, self._tree_slots(request))
                tail = self._forced_tail_slots(request, num_spec)
            else:
                num_spec, source = 0, None
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new + num_spec + tail > budget:
                num_spec = tail = 0
            if not self._allocate_or_preempt(request, num_new, num_spec + tail, preempted):
                break  # the request itself was preempted; everyone after it is lower priority
            scheduled.append(self._scheduled(request, num_new, num_spec, source, tail))
            scheduled[-1].spec_token_cost = spec_cost
            budget -= num_new + num_spec + tail
            i += 1
        if not preempted:
            budget = self._admit_waiting(budget, scheduled)
        self.num_gated_steps += self._held
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted_request_ids=preempted,
        )

    def _spec_cost(self) -> float:
        """One draft token's cost in plain decode steps of the current batch: proposing
        it, plus verifying it as the step-cost model prices it (a default until fitted)."""
        verify = self.cost_model.verify_cost(len(self.running))
        if verify is None:
            verify = self.config.default_verify_cost
        return self.draft_cost + verify

    def _num_spec_tokens(
        self, request: Request, spec_cost: float, adaptive: bool = True
    ) -> tuple[int, str | None]:
        """(k, the acceptance history that chose it) for a decoding request: its own fixed
        k if it asked for one, else adaptive up to the engine's maximum (0 while the gate
        is closed, ``adaptive`` False); never past the
        length limits (k drafts + 1 bonus). With ``spec_source`` set (a proposer that
        combines several), the proposer names the one it will use and its draft cost,
        and k comes from that proposer's history for this request."""
        if request.num_computed_tokens != request.num_tokens - 1:
            return 0, None  # still prefilling
        remaining = min(
            request.max_tokens - request.num_output_tokens,
            self.config.max_model_len - request.num_tokens,
        )
        max_k = min(self.config.num_spec_tokens, remaining - 1)
        if request.max_spec_tokens is not None:  # fixed k, never above the engine's
            return max(0, min(request.max_spec_tokens, max_k)), None
        if not adaptive:
            self._held = self._held or max_k > 0
            return 0, None
        source = None
        if self.spec_source is not None and max_k > 0:
            source, draft_cost = self.spec_source(request)
            spec_cost += draft_cost - self.draft_cost
        if self.gate is not None and max_k > 0 and not self._lane_open(source):
            self._held = True
            return 0, None
        return choose_num_spec_tokens(request.history_for(source), max_k, spec_cost), source

    def _tree_slots(self, request: Request) -> int:
        """Slots for a token tree: the configured most, within the length limits (the
        deepest path and one sampled token) and the 63 nodes a tree mask holds."""
        if request.max_spec_tokens is not None:  # fixed k: k nodes
            return 0
        remaining = min(
            request.max_tokens - request.num_output_tokens,
            self.config.max_model_len - request.num_tokens,
        )
        return max(0, min(self.config.spec_tree_max_nodes, remaining - 1, MAX_TREE_NODES))

    def _lane_open(self, source: str | None) -> bool:
        """The gate's answer for the lane of ``source``, asked once per lane per step."""
        allowed = self._lanes.get(source)
        if allowed is None:
            allowed = self._lanes[source] = self.gate.allow_lane(len(self.running), source)
        return allowed

    def _num_forced_tokens(self, request: Request) -> int:
        """The forced tokens that fit the length limits (and a last sampled token)."""
        if request.num_computed_tokens != request.num_tokens - 1:
            return 0
        remaining = min(
            request.max_tokens - request.num_output_tokens,
            self.config.max_model_len - request.num_tokens,
        )
        return max(0, min(request.num_forced_tokens, remaining - 1))

    def _forced_tail_slots(self, request: Request, num_spec: int) -> int:
        """Slots past k for what a constraint forces after the drafts, within the length
        limits (k drafts, the tail, one sampled token)."""
        if not num_spec or not request.forced_tail_slots:
            return 0
        remaining = min(
            request.max_tokens - request.num_output_tokens,
            self.config.max_model_len - request.num_tokens,
        )
        return max(0, min(request.forced_tail_slots, remaining - 1 - num_spec))

    def _allocate_or_preempt(
        self, request: Request, num_new: int, num_spec: int, preempted: list[str]
    ) -> bool:
        while self.kv.allocate_slots(request, num_new, num_spec) is None:
            victim = self.running[-1]  # lowest priority, latest arrival
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the KV, keep the tokens, wait again."""
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(request)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self._peek_waiting()
            if request is None:
                break
            cached_block_ids, num_cached = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_cached, budget)
            if self.kv.allocate_slots(request, num_new, 0, cached_block_ids) is None:
                break  # admission only when the pool can hold the next tokens
            heapq.heappop(self._waiting)
            if request.num_preemptions == 0:
                request.num_cached_prompt_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            bisect.insort(self.running, request, key=lambda r: r.sort_key)
            scheduled.append(self._scheduled(request, num_new, 0))
            budget -= num_new
        return budget

    def _scheduled(
        self, request: Request, num_new: int, num_spec: int, source: str | None = None,
        tail: int = 0,
    ) -> ScheduledRequest:  # fmt: skip
        return ScheduledRequest(
            request_id=request.request_id,
            num_computed_tokens=request.num_computed_tokens,
            num_scheduled_tokens=num_new,
            block_ids=self.kv.get_block_ids(request.request_id),
            needs_sample=request.num_computed_tokens + num_new == request.num_tokens,
            num_spec_tokens=num_spec,
            spec_source=source if num_spec else None,
            num_tail_slots=tail,
        )

    # ---- update -----------------------------------------------------------------------
    def update(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Apply a step's results. Returns the requests that got new tokens (finished
        ones included, already released)."""
        changed: list[Request] = []
        for item in output.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            request.num_computed_tokens = item.num_computed_tokens + item.num_scheduled_tokens
            if not item.needs_sample:
                continue
            num_accepted = runner_output.num_accepted.get(item.request_id, 0)
            if item.num_spec_tokens:
                # KV is valid for the last token and the accepted drafts; the rest of
                # the lookahead slots go back to the pool now.
                valid = item.num_computed_tokens + 1 + num_accepted
                request.num_computed_tokens = self.kv.rollback(request, valid)
            if item.num_spec_tokens and item.spec_source != FORCED:
                # A forced tail after the drafts is the constraint's, not the proposer's.
                num_drafts = item.num_proposed
                num_accepted = min(num_accepted, num_drafts)
                history = request.history_for(item.spec_source)
                history.record(_trials(item, runner_output, num_accepted), num_accepted)
                request.num_draft_tokens += num_drafts
                request.num_accepted_tokens += num_accepted
            request.append_output_tokens(runner_output.sampled_token_ids[item.request_id])
            if request.finish_reason is None and request.num_tokens >= self.config.max_model_len:
                request.finish_reason = "length"
            if request.finish_reason is not None:
                self.finish(request, request.finish_reason)
            changed.append(request)
        return changed


def _trials(item: ScheduledRequest, runner_output: ModelRunnerOutput, num_accepted: int) -> int:
    """What an acceptance history counts as drafts tried: a chain's drafts; for a token
    tree, the depth its walk reached, plus one where the last row it reached had
    candidates and none was kept (a rejection), so the history estimates the chance of
    going one level deeper, as a chain's does."""
    parents = item.spec_parents
    if parents is None:
        return item.num_proposed
    nodes = runner_output.accepted_nodes.get(item.request_id, [])
    last_row = nodes[-1] + 1 if nodes else 0
    return num_accepted + any(parent + 1 == last_row for parent in parents)
