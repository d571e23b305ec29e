"""The exporter counts exactly what a scripted workload did on a real engine."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest

from engine.core.llm_engine import LLMEngine
from engine.io.sampling_params import SamplingParams
from engine.observability.metrics import EngineMetrics
from engine.observability.request_log import REQUEST_LOGGER_NAME, RateLimit, RequestLogger
from tests.ops.scrape import parse, value

REPEATING = [40, 41, 42, 43, 44] * 6  # prompt lookup finds drafts in repeats
LONG = list(range(10, 50))  # 40 tokens: two full blocks for the prefix cache


@dataclass
class Workload:
    """What the workload did, counted from the outputs the engine handed back."""

    num_generated: int = 0
    num_prompt_tokens: int = 0  # of requests that produced a first token
    num_first_delta_tokens: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    num_draft: int = 0
    num_accepted: int = 0
    num_steps: int = 0
    sum_batch_size: int = 0
    num_verifications: int = 0
    sum_accepted_per_verification: int = 0
    prompt_lengths: list[int] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)

    def record(self, outputs, step) -> None:
        for output in outputs:
            self.num_generated += len(output.token_ids)
            if output.request_id not in self.seen and output.token_ids:
                self.seen.add(output.request_id)
                self.num_first_delta_tokens += len(output.token_ids)
                self.num_prompt_tokens += len(output.prompt_token_ids)
            if output.finished:
                reason = output.finish_reason
                self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
                self.num_draft += output.metrics.num_draft_tokens
                self.num_accepted += output.metrics.num_accepted_tokens
                self.prompt_lengths.append(len(output.prompt_token_ids))
        if step is not None:
            self.num_steps += 1
            self.sum_batch_size += step.batch_size
            self.num_verifications += len(step.accepted_per_verification)
            self.sum_accepted_per_verification += sum(step.accepted_per_verification)


class Driver:
    """Steps an LLMEngine and calls the observers the way AsyncEngine does."""

    def __init__(self, engine: LLMEngine, observers) -> None:
        self.engine = engine
        self.observers = observers
        self.workload = Workload()

    def step(self) -> None:
        outputs = self.engine.step()
        self._notify(outputs, self.engine.last_step)

    def abort(self, request_id: str) -> None:
        output = self.engine.abort_request(request_id)
        self.engine.refresh_stats()
        self._notify([output], None)

    def run(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()

    def _notify(self, outputs, step) -> None:
        self.workload.record(outputs, step)
        for observe in self.observers:
            observe(self.engine, outputs, step)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def driven(ngram_config):
    """Run the scripted workload once; yields (metrics, workload, engine, log records)."""
    engine = LLMEngine(ngram_config)
    metrics = EngineMetrics()
    records: list[logging.LogRecord] = []
    handler = _ListHandler(records)
    logging.getLogger(REQUEST_LOGGER_NAME).addHandler(handler)
    logging.getLogger(REQUEST_LOGGER_NAME).setLevel(logging.INFO)
    driver = Driver(engine, [metrics.observe_step, RequestLogger(json=True).observe_step])
    try:
        engine.add_request("repeat", REPEATING, greedy(24))
        engine.add_request("long", LONG, greedy(10))
        engine.add_request("aborted", [7, 8, 9, 10], greedy(50))
        for _ in range(3):
            driver.step()
        driver.abort("aborted")
        driver.run()
        # Every token id is a stop token: ends with "stop" after one token, and hits the
        # prefix cache that "long" left behind.
        stop_all = list(range(engine.vocab_size))
        engine.add_request("stopped", LONG, greedy(10, stop_token_ids=stop_all))
        driver.run()
        yield metrics, driver.workload, engine, records
    finally:
        logging.getLogger(REQUEST_LOGGER_NAME).removeHandler(handler)


class _ListHandler(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__()
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_counters_equal_the_workload(driven) -> None:
    metrics, work, engine, _ = driven
    s = parse(metrics.render())
    assert work.finish_reasons == {"length": 2, "abort": 1, "stop": 1}
    assert value(s, "specserve_generation_tokens_total") == work.num_generated > 0
    assert value(s, "specserve_prompt_tokens_total") == work.num_prompt_tokens
    for reason in ("stop", "length", "abort", "error"):
        count = value(s, "specserve_requests_finished_total", finish_reason=reason)
        assert count == work.finish_reasons.get(reason, 0), reason
    assert value(s, "specserve_spec_decode_num_draft_tokens_total") == work.num_draft > 0
    assert value(s, "specserve_spec_decode_num_accepted_tokens_total") == work.num_accepted
    gated = value(s, "specserve_spec_decode_num_gated_steps_total")
    assert gated == engine.stats.num_gated_steps == engine.scheduler.num_gated_steps
    assert work.num_accepted == work.sum_accepted_per_verification
    assert value(s, "specserve_prefix_cache_hits_total") >= 32  # "stopped" reused 2 blocks
    assert value(s, "specserve_prefix_cache_queries_total") == engine.stats.num_prefix_query_tokens
    assert value(s, "specserve_num_preemptions_total") == 0
    rollback = engine.stats.target_pool.num_blocks_freed_by_rollback
    assert value(s, "specserve_kv_cache_blocks_freed_by_rollback_total", pool="target") == rollback


def test_histograms_have_the_expected_counts(driven) -> None:
    metrics, work, _, _ = driven
    s = parse(metrics.render())
    num_finished = sum(work.finish_reasons.values())
    assert value(s, "specserve_time_to_first_token_seconds_count") == len(work.seen)
    assert value(s, "specserve_e2e_request_latency_seconds_count") == num_finished
    assert value(s, "specserve_request_queue_time_seconds_count") == num_finished
    assert value(s, "specserve_request_prompt_tokens_count") == num_finished
    assert value(s, "specserve_request_prompt_tokens_sum") == sum(work.prompt_lengths)
    assert value(s, "specserve_request_generation_tokens_sum") == work.num_generated
    itl_count = work.num_generated - work.num_first_delta_tokens
    assert value(s, "specserve_inter_token_latency_seconds_count") == itl_count
    assert value(s, "specserve_iteration_batch_size_count") == work.num_steps
    assert value(s, "specserve_iteration_batch_size_sum") == work.sum_batch_size
    assert value(s, "specserve_spec_decode_verification_phase_seconds_count") == work.num_steps
    per_verification = "specserve_spec_decode_accepted_tokens_per_verification"
    assert value(s, f"{per_verification}_count") == work.num_verifications > 0
    assert value(s, f"{per_verification}_sum") == work.num_accepted
    # le="+Inf" bucket equals the count: nothing fell outside the buckets' bookkeeping
    assert value(s, f"{per_verification}_bucket", le="+Inf") == work.num_verifications


def test_gauges_return_to_zero_when_idle(driven) -> None:
    metrics, _, engine, _ = driven
    assert not engine.has_unfinished_requests()
    s = parse(metrics.render())
    assert value(s, "specserve_num_requests_running") == 0
    assert value(s, "specserve_num_requests_waiting") == 0
    assert value(s, "specserve_kv_cache_usage_perc", pool="target") == 0
    assert value(s, "specserve_kv_cache_free_blocks", pool="target") == engine.num_kv_blocks - 1
    assert value(s, "specserve_spec_decode_speculative_length") == 0


def test_gauges_while_busy_and_after_an_abort(ngram_config) -> None:
    engine = LLMEngine(ngram_config)
    metrics = EngineMetrics()
    driver = Driver(engine, [metrics.observe_step])
    engine.add_request("a", REPEATING, greedy(8))
    engine.add_request("b", LONG, greedy(8))
    driver.step()
    s = parse(metrics.render())
    assert value(s, "specserve_num_requests_running") == 2
    assert value(s, "specserve_kv_cache_usage_perc", pool="target") > 0
    driver.abort("a")
    driver.abort("b")  # the engine will not step again: gauges must not stay stale
    s = parse(metrics.render())
    assert value(s, "specserve_num_requests_running") == 0
    assert value(s, "specserve_kv_cache_usage_perc", pool="target") == 0
    assert value(s, "specserve_requests_finished_total", finish_reason="abort") == 2


def test_one_log_line_per_finished_request_without_prompts(driven) -> None:
    _, work, _, records = driven
    lines = [r for r in records if r.getMessage().startswith("request finished")]
    assert sorted(r.fields["request_id"] for r in lines) == sorted(
        ["repeat", "long", "aborted", "stopped"]
    )
    by_id = {r.fields["request_id"]: r.fields for r in lines}
    assert by_id["stopped"]["finish_reason"] == "stop"
    assert by_id["long"]["completion_tokens"] == 10
    assert sum(f["completion_tokens"] for f in by_id.values()) == work.num_generated
    assert all("prompt" not in f for f in by_id.values())
    repeat = by_id["repeat"]
    if repeat["draft_tokens"]:
        assert repeat["acceptance_rate"] == round(
            repeat["accepted_tokens"] / repeat["draft_tokens"], 4
        )


def test_rpc_failure_lines_are_rate_limited_per_code(caplog) -> None:
    now = [0.0]
    limit = RateLimit(max_lines=2, window_s=10.0, clock=lambda: now[0])
    request_logger = RequestLogger(rpc_log_limit=limit)
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER_NAME)
    for _ in range(5):
        request_logger.on_rpc_error("INVALID_ARGUMENT", "request body is not a valid X")
    request_logger.on_rpc_error("CANCELLED", "cancelled by the client", "r-1")
    now[0] = 10.0  # a new window: the next line says how many were dropped
    request_logger.on_rpc_error("INVALID_ARGUMENT", "again")
    request_logger.on_rpc_error("INVALID_ARGUMENT", "again")
    lines = [(r.levelno, r.fields) for r in caplog.records if r.name == REQUEST_LOGGER_NAME]
    codes = [fields["code"] for _, fields in lines]
    assert codes == ["INVALID_ARGUMENT"] * 2 + ["CANCELLED"] + ["INVALID_ARGUMENT"] * 2
    assert [fields.get("suppressed") for _, fields in lines] == [None, None, None, 3, None]
    # The client's own cancellation is not a server warning.
    assert [level for level, _ in lines] == [logging.WARNING] * 2 + [logging.INFO] + [
        logging.WARNING
    ] * 2
    with pytest.raises(ValueError, match="max_lines"):
        RateLimit(max_lines=0)
    with pytest.raises(ValueError, match="window_s"):
        RateLimit(window_s=0)
