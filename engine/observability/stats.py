"""Engine-wide counters and gauges, updated by the loop thread after every step.

Counters only grow. The engine mutates its own EngineStats; other threads (the gRPC
stats RPC) read only ``snapshot()`` copies, published whole and never changed after.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace


@dataclass(slots=True)
class PoolStats:
    num_blocks: int = 0  # usable blocks (the null block excluded)
    num_free_blocks: int = 0  # free, evictable cached blocks included
    num_blocks_in_use: int = 0  # ref_cnt > 0: held by some request
    usage: float = 0.0
    num_blocks_freed_by_rollback: int = 0


@dataclass(slots=True)
class StepTimings:
    """Wall time of each phase of one step, seconds."""

    schedule_s: float = 0.0  # scheduler.schedule()
    draft_s: float = 0.0  # proposer: n-gram lookup or the draft-model burst
    prepare_s: float = 0.0  # batch building: token/position/slot/block-table tensors
    forward_s: float = 0.0  # target forward + sampling / verification
    update_s: float = 0.0  # scheduler.update(), rollback, detokenize, outputs

    @property
    def host_overhead_s(self) -> float:
        """Scheduling and batch building: the engine's own cost around the model."""
        return self.schedule_s + self.prepare_s


@dataclass(slots=True)
class StepRecord:
    """What one engine step did; the metrics exporter turns these into histograms."""

    batch_size: int
    num_batched_tokens: int
    draft_time_s: float
    forward_time_s: float  # verification phase: target forward + rejection sampling
    timings: StepTimings = field(default_factory=StepTimings)
    # per verified request this step: drafts proposed and drafts accepted
    drafts_per_verification: list[int] = field(default_factory=list)
    accepted_per_verification: list[int] = field(default_factory=list)


@dataclass(slots=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_steps: int = 0
    target_pool: PoolStats = field(default_factory=PoolStats)
    draft_pool: PoolStats | None = None
    # counters
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # steps adaptive k ran plain because the speculation gate measured speculating
    # steps slower at that batch size (scheduler/spec_gate.py)
    num_gated_steps: int = 0
    num_requests_finished: Counter = field(default_factory=Counter)  # by finish reason
    mean_speculative_length: float = 0.0

    def snapshot(self) -> EngineStats:
        """A deep copy (pools and counters too) for readers on other threads."""
        return replace(
            self,
            target_pool=replace(self.target_pool),
            draft_pool=None if self.draft_pool is None else replace(self.draft_pool),
            num_requests_finished=Counter(self.num_requests_finished),
        )
