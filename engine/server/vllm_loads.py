"""The engine's load as the gateway reads it: GetLoads, and a record on the KV-event
stream.

The gateway routes on these figures (queue, running set, KV usage, generation rate,
admission window). A worker that pushes records on its KV-event stream is not polled
while they flow, and one whose records stop is taken out of routing after the
gateway's staleness bound: so a stream carries a record on every batch and a
``load_only`` heartbeat while no batch flows (at once when the figures moved, else every
HEARTBEAT_S, every HEARTBEAT_BACKOFF_S once nothing changed for two heartbeats). Rates
(tokens per second, prefix-cache hit rate) are over the last RATE_WINDOW_S seconds.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

RATE_WINDOW_S = 2.0
HEARTBEAT_S = 1.0
HEARTBEAT_BACKOFF_S = 5.0
_MIN_SAMPLE_GAP_S = 0.05


class LoadFigures(NamedTuple):
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks held by requests
    gen_throughput: float = 0.0  # output tokens per second
    cache_hit_rate: float = 0.0  # prompt tokens served from the prefix cache
    max_running: int = 0  # max_num_seqs
    max_total_tokens: int = 0  # KV blocks x block size


class _Sample(NamedTuple):
    time: float
    num_generation_tokens: int
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int


class LoadTracker:
    """Reads the stats AsyncEngine publishes after every step; no engine call."""

    def __init__(self, engine: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self._engine = engine
        self._clock = clock
        self._samples: deque[_Sample] = deque()

    def figures(self) -> LoadFigures:
        stats = self._engine.stats
        info = self._engine.model_info
        limits = {
            "max_running": int(info.get("max_num_seqs") or 0),
            "max_total_tokens": int(info.get("num_kv_blocks") or 0)
            * int(info.get("block_size") or 0),
        }
        if stats is None:  # not loaded yet
            return LoadFigures(**limits)
        now = self._clock()
        oldest = self._sample(now, stats)
        elapsed = now - oldest.time
        new_tokens = stats.num_generation_tokens - oldest.num_generation_tokens
        queried = stats.num_prefix_query_tokens - oldest.num_prefix_query_tokens
        hits = stats.num_prefix_hit_tokens - oldest.num_prefix_hit_tokens
        if queried <= 0:  # nothing new: the lifetime rate
            queried, hits = stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens
        return LoadFigures(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_usage=stats.target_pool.usage,
            gen_throughput=new_tokens / elapsed if elapsed > 0 else 0.0,
            cache_hit_rate=hits / queried if queried > 0 else 0.0,
            **limits,
        )

    def _sample(self, now: float, stats: Any) -> _Sample:
        """Record ``stats`` now; return the oldest sample still in the window (the one
        just before it, when none is inside)."""
        samples = self._samples
        if not samples or now - samples[-1].time >= _MIN_SAMPLE_GAP_S:  # bounds the deque
            samples.append(
                _Sample(
                    now,
                    stats.num_generation_tokens,
                    stats.num_prefix_query_tokens,
                    stats.num_prefix_hit_tokens,
                )
            )
        while len(samples) > 2 and now - samples[1].time >= RATE_WINDOW_S:
            samples.popleft()
        return samples[0]


def scheduler_load(f: LoadFigures) -> vpb.SchedulerLoad:
    return vpb.SchedulerLoad(
        dp_rank=0,
        num_running_reqs=f.num_running,
        num_waiting_reqs=f.num_waiting,
        num_total_reqs=f.num_running + f.num_waiting,
        num_used_tokens=round(f.kv_usage * f.max_total_tokens),
        max_total_num_tokens=f.max_total_tokens,
        token_usage=f.kv_usage,
        gen_throughput=f.gen_throughput,
        cache_hit_rate=f.cache_hit_rate,
        utilization=f.kv_usage,
        max_running_requests=f.max_running,
    )


def engine_load(f: LoadFigures, telemetry: bool) -> cpb.EngineLoad:
    """The record; ``telemetry`` adds the fields only heartbeats and a stream's first
    record carry (the gateway's gauges, no routing input)."""
    record = cpb.EngineLoad(
        running_requests=f.num_running,
        waiting_requests=f.num_waiting,
        token_usage=f.kv_usage,
        # Blocks held by requests: cached free blocks are already left out of kv_usage.
        active_token_usage=f.kv_usage,
        gen_throughput=f.gen_throughput,
        max_running_requests=f.max_running,
    )
    if telemetry:
        record.cache_hit_rate = f.cache_hit_rate
        record.num_used_tokens = round(f.kv_usage * f.max_total_tokens)
        record.max_total_num_tokens = f.max_total_tokens
    return record


def load_changed(last: LoadFigures, current: LoadFigures) -> bool:
    """Worth a heartbeat now: any queue or window change, KV usage by half a percent,
    the rate by 5% or 50 tokens per second."""
    if (last.num_running, last.num_waiting, last.max_running) != (
        current.num_running,
        current.num_waiting,
        current.max_running,
    ) or abs(last.kv_usage - current.kv_usage) > 0.005:
        return True
    delta = abs(last.gen_throughput - current.gen_throughput)
    return delta > 50.0 or delta > 0.05 * max(last.gen_throughput, current.gen_throughput)


class LoadRecords:
    """One KV-event stream's records: numbered, telemetry-trimmed, paced."""

    def __init__(self, tracker: LoadTracker, clock: Callable[[], float] = time.monotonic):
        self._tracker = tracker
        self._clock = clock
        self._sample = 0
        self._last: LoadFigures | None = None
        self._last_sent_at = clock()
        self._idle_heartbeats = 0

    def stamp(self, batch: cpb.KvEventBatch) -> cpb.KvEventBatch:
        """``batch`` (a copy) with the record attached."""
        stamped = cpb.KvEventBatch()
        stamped.CopyFrom(batch)
        stamped.load.CopyFrom(self._record(load_only=False))
        self._last_sent_at = self._clock()
        self._idle_heartbeats = 0
        return stamped

    def heartbeat(self, sequence_number: int) -> cpb.KvEventBatch | None:
        """A ``load_only`` batch repeating ``sequence_number`` when one is due."""
        current = self._tracker.figures()
        changed = self._last is None or load_changed(self._last, current)
        due_after = HEARTBEAT_BACKOFF_S if self._idle_heartbeats >= 2 else HEARTBEAT_S
        if not changed and self._clock() - self._last_sent_at < due_after:
            return None
        batch = cpb.KvEventBatch(sequence_number=sequence_number, timestamp=time.time())
        batch.load.CopyFrom(self._record(load_only=True, figures=current))
        self._last_sent_at = self._clock()
        self._idle_heartbeats = 0 if changed else self._idle_heartbeats + 1
        return batch

    def _record(self, load_only: bool, figures: LoadFigures | None = None) -> cpb.EngineLoad:
        figures = figures or self._tracker.figures()
        self._sample += 1
        record = engine_load(figures, telemetry=load_only or self._sample == 1)
        record.sample = self._sample
        record.load_only = load_only
        self._last = figures
        return record
