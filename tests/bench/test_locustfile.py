"""deploy/loadtest/locustfile.py against a real server. Locust monkey-patches the
standard library with gevent on import, so it only ever runs in a subprocess here."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.bench.fake_openai import MODEL, FakeOpenAI
from tests.server.helpers import REPO_ROOT

# Not importorskip: importing locust here would monkey-patch this pytest process.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("locust") is None, reason="locust is not installed"
)

LOCUSTFILE = REPO_ROOT / "deploy" / "loadtest" / "locustfile.py"

# One user iteration, driven by hand through Locust's own Environment and event hook.
# argv: locustfile, host, user class (default SpecserveUser), task (default generate).
ONE_ITERATION = textwrap.dedent("""
    import importlib.util, json, sys
    spec = importlib.util.spec_from_file_location("locustfile", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from locust.env import Environment

    user_class = getattr(module, (sys.argv[3:] or ["SpecserveUser"])[0])
    env = Environment(user_classes=[user_class], host=sys.argv[2])
    events = []
    env.events.request.add_listener(lambda **kw: events.append(
        {k: kw[k] for k in ("request_type", "name", "response_time", "response_length")}
        | {"exception": None if kw["exception"] is None else repr(kw["exception"])}))
    user = user_class(env)
    user.on_start()
    getattr(user, (sys.argv[4:] or ["generate"])[0])()
    user.on_stop()
    print(json.dumps(events))
""")


def run(args: list[str], cwd=REPO_ROOT, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **env}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_one_iteration_fires_ttft_and_total_events(bench_server):
    done = run([sys.executable, "-c", ONE_ITERATION, str(LOCUSTFILE), bench_server.target],
               SPECSERVE_MAX_TOKENS="6")  # fmt: skip
    assert done.returncode == 0, done.stderr
    events = json.loads(done.stdout.strip().splitlines()[-1])
    assert [e["name"] for e in events] == ["Generate TTFT", "Generate"]
    ttft, total = events
    assert all(e["request_type"] == "grpc" and e["exception"] is None for e in events)
    assert 0 < ttft["response_time"] <= total["response_time"]
    assert total["response_length"] == 6  # max tokens; the tiny model rarely ends early


def test_failed_call_is_one_failure_event(bench_server):
    done = run([sys.executable, "-c", ONE_ITERATION, str(LOCUSTFILE), bench_server.target],
               SPECSERVE_MAX_TOKENS="0")  # fmt: skip
    assert done.returncode == 0, done.stderr
    events = json.loads(done.stdout.strip().splitlines()[-1])
    assert [e["name"] for e in events] == ["Generate"]
    assert "INVALID_ARGUMENT" in events[0]["exception"]


def test_headless_locust_run_reports_both_names(bench_server, tmp_path):
    args = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", "2",
            "-r", "2", "-t", "3s", "--host", bench_server.target, "--csv", "run",
            "--only-summary"]  # fmt: skip
    done = run(args, cwd=tmp_path, SPECSERVE_MAX_TOKENS="4")
    assert done.returncode == 0, done.stderr[-2000:]
    with open(tmp_path / "run_stats.csv") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    for name in ("Generate", "Generate TTFT"):
        assert rows[name]["Type"] == "grpc"
        assert int(rows[name]["Request Count"]) > 0 and rows[name]["Failure Count"] == "0"
    assert "Chat completion" not in rows  # a gRPC host runs the gRPC user only


# ---- GatewayUser: OpenAI streaming chat, against tests/bench/fake_openai.py -----------
def gateway_iteration(server: FakeOpenAI, **env: str) -> list[dict]:
    args = [sys.executable, "-c", ONE_ITERATION, str(LOCUSTFILE), server.url, "GatewayUser",
            "chat"]  # fmt: skip
    done = run(args, SPECSERVE_MAX_TOKENS="6", **env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_gateway_iteration_fires_ttft_and_total_events():
    with FakeOpenAI(ttft_s=0.1, itl_s=0.01, num_chunks=3, tokens_per_chunk=2,
                    api_key="k3y") as server:  # fmt: skip
        events = gateway_iteration(server, SPECSERVE_API_KEY="k3y")
        ((path, body, headers),) = server.requests
    assert [e["name"] for e in events] == ["Chat completion TTFT", "Chat completion"]
    ttft, total = events
    assert all(e["request_type"] == "http" and e["exception"] is None for e in events)
    assert 100 <= ttft["response_time"] <= total["response_time"]
    assert total["response_length"] == 6  # usage.completion_tokens
    assert path == "/v1/chat/completions" and headers["Authorization"] == "Bearer k3y"
    assert body["model"] == MODEL and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 6 and body["messages"][0]["role"] == "user"


@pytest.mark.parametrize("failure", ["429", "drop", "error_event"])
def test_gateway_failed_stream_is_one_failure_event(failure):
    with FakeOpenAI(num_chunks=3) as server:
        server.failures = {1: failure}
        events = gateway_iteration(server)
    assert events[-1]["name"] == "Chat completion" and events[-1]["exception"] is not None
    assert [e["name"] for e in events].count("Chat completion") == 1
    if failure == "429":
        assert "HTTP 429" in events[-1]["exception"] and len(events) == 1


def test_headless_locust_run_against_an_http_host_runs_the_gateway_user(tmp_path):
    with FakeOpenAI(ttft_s=0.01, num_chunks=2) as server:
        args = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", "2",
                "-r", "2", "-t", "3s", "--host", server.url, "--csv", "run",
                "--only-summary"]  # fmt: skip
        done = run(args, cwd=tmp_path, SPECSERVE_MAX_TOKENS="4")
    assert done.returncode == 0, done.stderr[-2000:]
    with open(tmp_path / "run_stats.csv") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    for name in ("Chat completion", "Chat completion TTFT"):
        assert rows[name]["Type"] == "http"
        assert int(rows[name]["Request Count"]) > 0 and rows[name]["Failure Count"] == "0"
    assert "Generate" not in rows
