"""Exporter surface: names, hooks, flags, log formats."""

from __future__ import annotations

import argparse
import json
import logging

import pytest

from engine.io.outputs import RequestMetrics, RequestOutput
from engine.observability.metrics import DEFAULT_METRICS_PORT, EngineMetrics, add_ops_args
from engine.observability.request_log import (
    JsonFormatter,
    RequestLogger,
    TextFormatter,
    setup_logging,
)
from tests.ops.scrape import metric_names, parse, value


def exported_families(metrics: EngineMetrics) -> set[str]:
    return {
        family.name for family in metrics.registry.collect() if family.name.startswith("specserve_")
    }


EXPECTED_FAMILIES = {
    # gauges
    "specserve_model", "specserve_num_requests_running", "specserve_num_requests_waiting",
    "specserve_kv_cache_usage_perc", "specserve_kv_cache_free_blocks",
    "specserve_spec_decode_speculative_length",
    # counters (exposed with a _total suffix)
    "specserve_prompt_tokens", "specserve_generation_tokens", "specserve_requests_finished",
    "specserve_num_preemptions", "specserve_prefix_cache_queries", "specserve_prefix_cache_hits",
    "specserve_spec_decode_num_draft_tokens", "specserve_spec_decode_num_accepted_tokens",
    "specserve_spec_decode_num_gated_steps",
    "specserve_kv_cache_blocks_freed_by_rollback", "specserve_requests_rejected",
    "specserve_grpc_errors",
    # histograms
    "specserve_time_to_first_token_seconds", "specserve_inter_token_latency_seconds",
    "specserve_e2e_request_latency_seconds", "specserve_request_queue_time_seconds",
    "specserve_request_prompt_tokens", "specserve_request_generation_tokens",
    "specserve_iteration_batch_size", "specserve_spec_decode_draft_phase_seconds",
    "specserve_spec_decode_verification_phase_seconds",
    "specserve_spec_decode_accepted_tokens_per_verification",
}  # fmt: skip


def test_names_have_the_prefix_and_no_colons() -> None:
    metrics = EngineMetrics()
    assert exported_families(metrics) == EXPECTED_FAMILIES
    assert all(":" not in name for name in metric_names(parse(metrics.render())))
    own = [f.name for f in metrics.registry.collect() if not f.name.startswith(("process_",
           "python_"))]  # fmt: skip
    assert all(name.startswith("specserve_") for name in own)


def test_two_exporters_do_not_collide() -> None:
    EngineMetrics()
    EngineMetrics()  # each has its own registry


def test_rpc_errors_and_admission_rejections() -> None:
    metrics = EngineMetrics()
    metrics.on_rpc_error("RESOURCE_EXHAUSTED")
    metrics.on_rpc_error("RESOURCE_EXHAUSTED")
    metrics.on_rpc_error("UNAVAILABLE")
    metrics.on_admission_rejected()
    s = parse(metrics.render())
    assert value(s, "specserve_grpc_errors_total", code="RESOURCE_EXHAUSTED") == 2
    assert value(s, "specserve_grpc_errors_total", code="UNAVAILABLE") == 1
    assert value(s, "specserve_requests_rejected_total") == 1


def test_observers_never_raise_into_the_engine_loop(caplog) -> None:
    broken_engine = object()  # no stats, no model_info: every access fails
    metrics, request_logger = EngineMetrics(), RequestLogger()
    for _ in range(3):
        metrics.observe_step(broken_engine, [object()], None)
        request_logger.observe_step(broken_engine, [object()], None)
    failures = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failures) == 2  # logged once each, not once per step


def test_ops_flags_and_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_ops_args(parser)
    args = parser.parse_args([])
    assert (args.metrics_port, args.log_format, args.log_prompts) == (9400, "text", False)
    assert DEFAULT_METRICS_PORT == 9400
    args = parser.parse_args(["--metrics-port", "0", "--log-format", "json", "--log-prompts"])
    assert (args.metrics_port, args.log_format, args.log_prompts) == (0, "json", True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-format", "xml"])


class _Tokenizer:
    def decode(self, token_ids: list[int]) -> str:
        return "SECRET PROMPT"


class _Engine:
    tokenizer = _Tokenizer()


def finished_output(request_id: str = "req-1", reason: str = "stop") -> RequestOutput:
    metrics = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.5, first_token_time=2.0,
                             finished_time=4.0, num_prompt_tokens=3, num_draft_tokens=8,
                             num_accepted_tokens=6)  # fmt: skip
    return RequestOutput(request_id, [1, 2, 3], [7], "x", True, reason, metrics)


def log_lines(capsys, log_format: str, log_prompts: bool) -> list[str]:
    setup_logging(log_format)
    try:
        request_logger = RequestLogger(json=log_format == "json", log_prompts=log_prompts)
        running = RequestOutput("req-1", [1, 2, 3], [5, 6], "ab", False, None,
                                finished_output().metrics)  # fmt: skip
        request_logger.observe_step(_Engine(), [running], None)
        request_logger.observe_step(_Engine(), [finished_output()], None)
    finally:
        logging.getLogger().handlers.clear()
    return capsys.readouterr().err.strip().splitlines()


def test_json_request_log_line(capsys) -> None:
    (line,) = log_lines(capsys, "json", log_prompts=False)
    entry = json.loads(line)
    assert entry["msg"] == "request finished"
    assert entry["request_id"] == "req-1"
    assert entry["completion_tokens"] == 3
    assert entry["prompt_tokens"] == 3
    assert entry["acceptance_rate"] == 0.75
    assert entry["ttft_s"] == 1.0
    assert entry["finish_reason"] == "stop"
    assert "SECRET" not in line


def test_text_request_log_line_and_log_prompts(capsys) -> None:
    (line,) = log_lines(capsys, "text", log_prompts=False)
    assert "request finished request_id=req-1 finish_reason=stop" in line
    assert "SECRET" not in line
    (line,) = log_lines(capsys, "text", log_prompts=True)
    assert 'prompt="SECRET PROMPT"' in line
    (line,) = log_lines(capsys, "json", log_prompts=True)
    assert json.loads(line)["prompt"] == "SECRET PROMPT"


def test_rpc_error_log_line(capsys) -> None:
    setup_logging("json")
    try:
        RequestLogger(json=True).on_rpc_error("INVALID_ARGUMENT", "max_tokens must\nbe >= 1", "r-9")
    finally:
        logging.getLogger().handlers.clear()
    entry = json.loads(capsys.readouterr().err)
    assert entry["level"] == "WARNING" and entry["msg"].startswith("rpc failed")
    assert (entry["code"], entry["details"], entry["request_id"]) == (
        "INVALID_ARGUMENT",
        "max_tokens must be >= 1",
        "r-9",
    )


def test_formatters_keep_errors_on_one_line() -> None:
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        record = logging.getLogger("x").makeRecord(
            "x", logging.ERROR, __file__, 1, "failed\nhere", None, __import__("sys").exc_info()
        )
    assert "\n" not in TextFormatter().format(record)
    entry = json.loads(JsonFormatter().format(record))
    assert entry["exc"] == "RuntimeError: boom second line"
    with pytest.raises(ValueError, match="log_format"):
        setup_logging("xml")


def test_operations_doc_lists_every_metric_and_flag() -> None:
    from tests.ops.deploy_files import REPO_ROOT

    doc = (REPO_ROOT / "docs" / "operations.md").read_text()
    suffix = {"counter": "_total", "info": "_info"}
    for family in EngineMetrics().registry.collect():
        if family.name.startswith("specserve_"):
            assert f"`{family.name}{suffix.get(family.type, '')}`" in doc, family.name
    for flag in ("--metrics-port", "--log-format", "--log-prompts"):
        assert f"`{flag}`" in doc
