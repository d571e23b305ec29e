"""A scripted workload against a real gRPC server; /metrics is scraped over HTTP."""

from __future__ import annotations

import threading
import urllib.request
from collections import Counter

import grpc
import pytest

from engine.client import SpecserveClient
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.observability.metrics import EngineMetrics
from engine.rpc import generation_pb2 as pb
from engine.rpc import generation_pb2_grpc as pb_grpc
from tests.ops.scrape import parse, value
from tests.server.helpers import InProcessServer, wait_until

PROMPTS = [
    "abc abc abc abc abc abc",
    "The capital of France is Paris. The capital of",
    "0 1 0 1 0 1",
]


@pytest.fixture(scope="module")
def served(ngram_config):
    """An in-process server wired to the exporter the way `specserve serve` wires it."""
    metrics = EngineMetrics()
    server = InProcessServer(ngram_config)
    server.engine.step_observers.append(metrics.observe_step)
    server.server.on_rpc_error = metrics.on_rpc_error
    port = metrics.start_http_server(0, addr="127.0.0.1")
    with server:
        yield server, metrics, f"http://127.0.0.1:{port}/metrics"
    metrics.stop_http_server()


def scrape(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200
        return parse(response.read())


def test_metrics_endpoint_counts_the_workload(served) -> None:
    server, _metrics, url = served
    usages, reasons = [], Counter()
    with SpecserveClient(server.target) as client:
        for i, prompt in enumerate(PROMPTS * 2):
            deltas = list(client.generate(prompt, max_tokens=6 + i, temperature=0, ignore_eos=True))
            usages.append(deltas[-1].usage)
            reasons[deltas[-1].finish_reason] += 1
        with pytest.raises(grpc.RpcError) as bad:
            client.generate_complete("", max_tokens=4)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    wait_until(lambda: scrape(url)[("specserve_num_requests_running", frozenset())] == 0,
               10, "running requests to drain")  # fmt: skip
    s = scrape(url)
    completion = sum(u.completion_tokens for u in usages)
    assert value(s, "specserve_generation_tokens_total") == completion
    assert value(s, "specserve_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert value(s, "specserve_requests_finished_total", finish_reason="length") == len(usages)
    assert reasons == {"length": len(usages)}
    draft = sum(u.draft_tokens for u in usages)
    assert value(s, "specserve_spec_decode_num_draft_tokens_total") == draft > 0
    accepted = sum(u.accepted_draft_tokens for u in usages)
    assert value(s, "specserve_spec_decode_num_accepted_tokens_total") == accepted
    assert value(s, "specserve_grpc_errors_total", code="INVALID_ARGUMENT") == 1
    assert value(s, "specserve_time_to_first_token_seconds_count") == len(usages)
    assert value(s, "specserve_e2e_request_latency_seconds_count") == len(usages)
    assert value(s, "specserve_request_generation_tokens_sum") == completion
    assert value(s, "specserve_inter_token_latency_seconds_count") <= completion - len(usages)
    assert value(s, "specserve_num_requests_waiting") == 0
    assert value(s, "specserve_kv_cache_usage_perc", pool="target") == 0


def test_container_healthcheck_script(served) -> None:
    import importlib.util

    from tests.ops.deploy_files import DEPLOY

    spec = importlib.util.spec_from_file_location(
        "healthcheck", DEPLOY / "docker" / "healthcheck.py"
    )
    healthcheck = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(healthcheck)
    server, _, _ = served
    port = str(server.server.port)
    assert healthcheck.main(["--port", port]) == 0
    assert healthcheck.main(["--port", port, "--service", "no.such.Service"]) == 1


class _GatedEngine:
    """The real engine, whose step() waits until ``gate`` is set: a request stays in
    flight, deterministically, for as long as the test needs."""

    def __init__(self, inner: LLMEngine, gate: threading.Event) -> None:
        self._inner = inner
        self._gate = gate

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def step(self):
        self._gate.wait(60)
        return self._inner.step()


def test_cancelled_and_expired_streams_are_counted(ops_model_dir) -> None:
    gate = threading.Event()
    config = EngineConfig(model=str(ops_model_dir), device="cpu", num_kv_blocks=64)
    server = InProcessServer(config, engine_factory=lambda c: _GatedEngine(LLMEngine(c), gate))
    metrics = EngineMetrics()
    server.server.on_rpc_error = metrics.on_rpc_error
    url = f"http://127.0.0.1:{metrics.start_http_server(0, addr='127.0.0.1')}/metrics"

    def num_errors(code: str) -> float:
        return scrape(url).get(("specserve_grpc_errors_total", frozenset({("code", code)})), 0)

    request = pb.GenerateRequest(text="Hello", sampling=pb.SamplingOptions(max_tokens=4))
    with server, grpc.insecure_channel(server.target) as channel:
        try:
            stub = pb_grpc.GenerationStub(channel)
            stream = stub.Generate(request)  # no deadline: cancelled by the client
            wait_until(lambda: server.server.lifecycle.num_in_flight == 1, 30, "stream in flight")
            stream.cancel()
            wait_until(lambda: num_errors("CANCELLED") == 1, 30, "CANCELLED counted")
            with pytest.raises(grpc.RpcError) as expired:
                list(stub.Generate(request, timeout=0.5))
            assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            wait_until(
                lambda: num_errors("DEADLINE_EXCEEDED") == 1, 30, "DEADLINE_EXCEEDED counted"
            )
            assert num_errors("CANCELLED") == 1
        finally:
            gate.set()
            metrics.stop_http_server()
