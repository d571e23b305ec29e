"""Prometheus metrics for specserve, fed by the engine loop's step observers.

    metrics = EngineMetrics()
    async_engine.step_observers.append(metrics.observe_step)
    server.on_rpc_error = metrics.on_rpc_error
    metrics.start_http_server(args.metrics_port)          # GET :9400/metrics

Counters are deltas of ``EngineStats`` (which only grow), so they equal what the engine
did exactly; histograms are observed from finished outputs and ``StepRecord``s. Names
follow vLLM's families with the ``specserve_`` prefix and no colons; docs/operations.md
explains each one.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client import start_http_server as _start_http_server

logger = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9400
FINISH_REASONS = ("stop", "length", "abort", "error")
POOLS = ("target", "draft")

# Buckets: latencies span CPU development (seconds) to GPU serving (milliseconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0,
                           15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
                           1920.0)  # fmt: skip
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64,
                 1.28, 2.56, 5.12)  # fmt: skip
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000,
                  50000, 100000)  # fmt: skip
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
ACCEPTED_BUCKETS = tuple(range(17))  # num_speculative_tokens is at most 16


@dataclass(slots=True)
class _Progress:
    """Per running request: when its last delta was observed and tokens so far."""

    last_time: float
    num_tokens: int


class EngineMetrics:
    """Every specserve metric, in its own registry unless one is given.

    ``observe_step`` runs in the engine loop thread (the only writer of the per-request
    state); ``on_rpc_error`` and ``on_admission_rejected`` may be called from any
    thread (prometheus_client is thread-safe).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        if registry is None:
            registry = CollectorRegistry()
            for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
                registry.register(collector)
        self.registry = registry
        self._last: dict[tuple[str, str], int] = {}
        self._progress: dict[str, _Progress] = {}
        self._http: tuple[Any, threading.Thread] | None = None
        self._has_model_info = False
        self._last_num_drafts = 0  # draft tokens proposed in the last observed step
        self._num_failures = 0
        self._register_gauges(registry)
        self._register_counters(registry)
        self._register_histograms(registry)

    # ---- registration ------------------------------------------------------------
    def _register_gauges(self, r: CollectorRegistry) -> None:
        self.model_info = Info("specserve_model", "Model being served", registry=r)
        self.requests_running = Gauge(
            "specserve_num_requests_running", "Requests in the running batch", registry=r
        )
        self.requests_waiting = Gauge(
            "specserve_num_requests_waiting", "Requests waiting to be scheduled", registry=r
        )
        self.kv_cache_usage = Gauge(
            "specserve_kv_cache_usage_perc",
            "Fraction of KV blocks held by requests (1 = full)",
            ["pool"],
            registry=r,
        )
        self.kv_cache_free_blocks = Gauge(
            "specserve_kv_cache_free_blocks",
            "Free KV blocks (evictable prefix-cached blocks included)",
            ["pool"],
            registry=r,
        )
        self.speculative_length = Gauge(
            "specserve_spec_decode_speculative_length",
            "Mean draft tokens proposed per speculating request in the last step",
            registry=r,
        )

    def _register_counters(self, r: CollectorRegistry) -> None:
        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, list(labels), registry=r)

        self.prompt_tokens = counter("specserve_prompt_tokens", "Prefilled prompt tokens")
        self.generation_tokens = counter("specserve_generation_tokens", "Generated tokens")
        self.requests_finished = counter(
            "specserve_requests_finished", "Finished requests", ("finish_reason",)
        )
        for reason in FINISH_REASONS:
            self.requests_finished.labels(reason)
        self.preemptions = counter("specserve_num_preemptions", "Requests preempted")
        self.prefix_queries = counter(
            "specserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = counter(
            "specserve_prefix_cache_hits", "Prompt tokens found in the prefix cache"
        )
        self.draft_tokens = counter(
            "specserve_spec_decode_num_draft_tokens", "Draft tokens proposed"
        )
        self.accepted_tokens = counter(
            "specserve_spec_decode_num_accepted_tokens", "Draft tokens accepted by verification"
        )
        self.gated_steps = counter(
            "specserve_spec_decode_num_gated_steps",
            "Decode steps run without drafts because speculating steps measured slower "
            "at that batch size",
        )
        self.blocks_freed_by_rollback = counter(
            "specserve_kv_cache_blocks_freed_by_rollback",
            "KV blocks returned to the pool by rollback of rejected drafts",
            ("pool",),
        )
        self.requests_rejected = counter(
            "specserve_requests_rejected", "Requests rejected by admission control (queue full)"
        )
        self.grpc_errors = counter(
            "specserve_grpc_errors", "RPCs that ended with a non-OK status", ("code",)
        )

    def _register_histograms(self, r: CollectorRegistry) -> None:
        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=r)

        self.ttft = histogram(
            "specserve_time_to_first_token_seconds", "Arrival to first token", TTFT_BUCKETS
        )
        self.itl = histogram(
            "specserve_inter_token_latency_seconds",
            "Time between output tokens (a delta of n tokens counts n times)",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "specserve_e2e_request_latency_seconds",
            "Arrival to finish",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "specserve_request_queue_time_seconds",
            "Arrival to first scheduled",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prompt_length = histogram(
            "specserve_request_prompt_tokens", "Prompt length of finished requests", LENGTH_BUCKETS
        )
        self.generation_length = histogram(
            "specserve_request_generation_tokens",
            "Generated tokens of finished requests",
            LENGTH_BUCKETS,
        )
        self.batch_size = histogram(
            "specserve_iteration_batch_size", "Requests scheduled per engine step",
            BATCH_SIZE_BUCKETS,
        )  # fmt: skip
        self.draft_phase = histogram(
            "specserve_spec_decode_draft_phase_seconds",
            "Draft phase of a step that proposed drafts",
            PHASE_BUCKETS,
        )
        self.verification_phase = histogram(
            "specserve_spec_decode_verification_phase_seconds",
            "Packed target forward plus verification/sampling, per step",
            PHASE_BUCKETS,
        )
        self.accepted_per_verification = histogram(
            "specserve_spec_decode_accepted_tokens_per_verification",
            "Draft tokens accepted per verified request",
            ACCEPTED_BUCKETS,
        )

    # ---- hooks -------------------------------------------------------------------
    def observe_step(self, llm_engine: Any, outputs: list[Any], step: Any | None) -> None:
        """AsyncEngine step observer: ``step`` is None after an abort. Never raises."""
        try:
            self._observe_step(llm_engine, outputs, step)
        except Exception:  # a metrics bug must never stop the engine loop
            self._num_failures += 1
            if self._num_failures == 1:
                logger.exception("metrics observer failed (later failures are not logged)")

    def _observe_step(self, llm_engine: Any, outputs: list[Any], step: Any | None) -> None:
        now = time.monotonic()
        if not self._has_model_info:
            self._set_model_info(llm_engine)
        stats = llm_engine.stats
        self._observe_counters(stats)
        for output in outputs:
            self._observe_output(output, now)
        if step is not None:
            self._observe_step_record(step)
        self._set_gauges(llm_engine, stats, step)

    def on_engine_failed(self, exc: BaseException) -> None:
        """AsyncEngine failure observer: the engine will never step again, so its last
        queue and KV numbers are not current: the per-pool series go away and the
        others read NaN (unknown) from now on."""
        for gauge in (self.requests_running, self.requests_waiting, self.speculative_length):
            gauge.set(float("nan"))
        self.kv_cache_usage.clear()
        self.kv_cache_free_blocks.clear()

    def on_rpc_error(self, code_name: str) -> None:
        """An RPC ended with status ``code_name`` ("INVALID_ARGUMENT", ...)."""
        self.grpc_errors.labels(code_name).inc()

    def on_admission_rejected(self) -> None:
        """A request was refused because the waiting queue was full."""
        self.requests_rejected.inc()

    # ---- HTTP endpoint -----------------------------------------------------------
    def start_http_server(self, port: int = DEFAULT_METRICS_PORT, addr: str = "0.0.0.0") -> int:
        """Serve the registry at http://addr:port/metrics; returns the bound port."""
        server, thread = _start_http_server(port, addr=addr, registry=self.registry)
        self._http = (server, thread)
        return server.server_address[1]

    def stop_http_server(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(5)
            self._http = None

    def render(self) -> bytes:
        """The exposition text, as GET /metrics returns it."""
        return generate_latest(self.registry)

    # ---- internals ---------------------------------------------------------------
    def _set_model_info(self, llm_engine: Any) -> None:
        self._has_model_info = True
        info = getattr(llm_engine, "model_info", None)
        if callable(info):
            self.model_info.info({k: str(v) for k, v in info().items()})

    def _inc_to(self, counter: Counter, key: tuple[str, str], total: int) -> int:
        """Advance ``counter`` to the stats total ``total``; returns the delta."""
        delta = total - self._last.get(key, 0)
        if delta < 0:  # a new engine started counting from zero
            delta = total
        self._last[key] = total
        if delta:
            counter.inc(delta)
        return delta

    def _observe_counters(self, stats: Any) -> None:
        inc = self._inc_to
        inc(self.prompt_tokens, ("prompt", ""), stats.num_prompt_tokens)
        inc(self.generation_tokens, ("generation", ""), stats.num_generation_tokens)
        inc(self.preemptions, ("preemptions", ""), stats.num_preemptions)
        inc(self.prefix_queries, ("prefix_queries", ""), stats.num_prefix_query_tokens)
        inc(self.prefix_hits, ("prefix_hits", ""), stats.num_prefix_hit_tokens)
        inc(self.accepted_tokens, ("accepted", ""), stats.num_accepted_tokens)
        self._last_num_drafts = inc(self.draft_tokens, ("draft", ""), stats.num_draft_tokens)
        inc(self.gated_steps, ("gated", ""), stats.num_gated_steps)
        for reason, total in stats.num_requests_finished.items():
            inc(self.requests_finished.labels(reason), ("finished", reason), total)
        for pool_name, pool in self._pools(stats):
            rollback = self.blocks_freed_by_rollback.labels(pool_name)
            inc(rollback, ("rollback", pool_name), pool.num_blocks_freed_by_rollback)

    def _observe_output(self, output: Any, now: float) -> None:
        progress = self._progress.get(output.request_id)
        num_new = len(output.token_ids)
        if progress is None and num_new:
            ttft = output.metrics.time_to_first_token
            if ttft is not None:
                self.ttft.observe(ttft)
            progress = self._progress[output.request_id] = _Progress(now, 0)
        elif progress is not None and num_new:
            per_token = (now - progress.last_time) / num_new
            for _ in range(num_new):
                self.itl.observe(per_token)
            progress.last_time = now
        if progress is not None:
            progress.num_tokens += num_new
        if output.finished:
            self._observe_finished(output, progress)

    def _observe_finished(self, output: Any, progress: _Progress | None) -> None:
        self._progress.pop(output.request_id, None)
        m = output.metrics
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        if m.queue_time is not None:
            self.queue_time.observe(m.queue_time)
        self.prompt_length.observe(m.num_prompt_tokens)
        self.generation_length.observe(progress.num_tokens if progress else 0)

    def _observe_step_record(self, step: Any) -> None:
        self.batch_size.observe(step.batch_size)
        self.verification_phase.observe(step.forward_time_s)
        if step.accepted_per_verification:
            self.draft_phase.observe(step.draft_time_s)
        for num_accepted in step.accepted_per_verification:
            self.accepted_per_verification.observe(num_accepted)

    def _set_gauges(self, llm_engine: Any, stats: Any, step: Any | None) -> None:
        idle = not llm_engine.has_unfinished_requests()
        # After an abort the engine does not step again while idle, so the queue sizes
        # in stats can be one step old: idle means both are zero.
        self.requests_running.set(0 if idle else stats.num_running)
        self.requests_waiting.set(0 if idle else stats.num_waiting)
        for pool_name, pool in self._pools(stats):
            self.kv_cache_usage.labels(pool_name).set(pool.usage)
            self.kv_cache_free_blocks.labels(pool_name).set(pool.num_free_blocks)
        if idle:
            self.speculative_length.set(0)
        elif step is not None:
            num_verified = len(step.accepted_per_verification)
            drafts = self._last_num_drafts
            self.speculative_length.set(drafts / num_verified if num_verified else 0)

    @staticmethod
    def _pools(stats: Any) -> list[tuple[str, Any]]:
        pools = [("target", stats.target_pool)]
        if stats.draft_pool is not None:
            pools.append(("draft", stats.draft_pool))
        return pools


def add_ops_args(parser: argparse.ArgumentParser) -> None:
    """--metrics-port, --log-format, --log-prompts (for `specserve serve`)."""
    g = parser.add_argument_group("observability")
    g.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help=f"Prometheus /metrics port (default {DEFAULT_METRICS_PORT}; 0 turns it off)",
    )
    g.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="text: one line per record; json: one JSON object per line (default text)",
    )
    g.add_argument(
        "--log-prompts",
        action="store_true",
        help="include prompt text in request logs (off by default: prompts may be private)",
    )
