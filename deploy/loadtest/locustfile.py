"""Locust load test for specserve: each user streams Generate over gRPC and reports two
Locust events per request (request_type "grpc"):

    "Generate TTFT"  response_time = ms to the first streamed token, response_length 0
    "Generate"       response_time = ms to the end of the stream, response_length = tokens;
                     a failed call is one failure here, with the gRPC status as exception

    locust -f deploy/loadtest/locustfile.py --host 127.0.0.1:50051 \\
        --headless -u 32 -r 4 -t 2m --csv specserve

Settings (environment): SPECSERVE_MAX_TOKENS (64), SPECSERVE_TEMPERATURE (0),
SPECSERVE_API_KEY, SPECSERVE_PROMPTS (a JSONL file with a "prompt" per line; default:
the built-in chat prompts), SPECSERVE_CHAT (1: apply the chat template), SPECSERVE_TIMEOUT_S
(60), SPECSERVE_WAIT_S (think time between requests, 0). Needs specserve importable
(pip install specserve, or run from the repository root).
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

# gRPC's blocking calls must yield to gevent, or one streaming user stalls all others.
# This has to run before any channel exists.
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import grpc  # noqa: E402
from locust import User, constant, task  # noqa: E402

try:
    import engine.client  # noqa: F401
except ImportError:  # running from a checkout: deploy/loadtest/ -> repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.benchmarks.workloads import CHAT_PROMPTS, load_prompts  # noqa: E402
from engine.client import SpecserveClient, build_request  # noqa: E402

REQUEST_TYPE = "grpc"


def measure_stream(client: SpecserveClient, request, fire, timeout_s: float | None) -> None:
    """Stream one Generate and fire the TTFT and total-time events (see the docstring)."""
    start = time.perf_counter()
    first_token_ms = None
    num_tokens = 0
    error: Exception | None = None
    try:
        for delta in client.generate(request=request, timeout=timeout_s):
            if delta.token_ids and first_token_ms is None:
                first_token_ms = (time.perf_counter() - start) * 1e3
                fire(request_type=REQUEST_TYPE, name="Generate TTFT",
                     response_time=first_token_ms, response_length=0, exception=None,
                     context={})  # fmt: skip
            num_tokens += len(delta.token_ids)
    except grpc.RpcError as exc:
        error = exc
    fire(request_type=REQUEST_TYPE, name="Generate",
         response_time=(time.perf_counter() - start) * 1e3, response_length=num_tokens,
         exception=error, context={"ttft_ms": first_token_ms})  # fmt: skip


def _prompts() -> list[str]:
    path = os.environ.get("SPECSERVE_PROMPTS")
    if not path:
        return list(CHAT_PROMPTS)
    num_lines = sum(1 for line in Path(path).read_text().splitlines() if line.strip())
    return load_prompts(path, num_lines)


def _target(host: str | None) -> str:
    if not host:
        raise ValueError("give the server with --host HOST:PORT")
    return host.split("://", 1)[-1].rstrip("/")


class SpecserveUser(User):
    wait_time = constant(float(os.environ.get("SPECSERVE_WAIT_S", "0")))

    def on_start(self) -> None:
        self.client = SpecserveClient(
            _target(self.host or self.environment.host),
            api_key=os.environ.get("SPECSERVE_API_KEY") or None,
        )
        self.prompts = _prompts()
        self.max_tokens = int(os.environ.get("SPECSERVE_MAX_TOKENS", "64"))
        self.temperature = float(os.environ.get("SPECSERVE_TEMPERATURE", "0"))
        self.chat = os.environ.get("SPECSERVE_CHAT", "1") == "1"
        self.timeout_s = float(os.environ.get("SPECSERVE_TIMEOUT_S", "60"))

    def on_stop(self) -> None:
        self.client.close()

    @task
    def generate(self) -> None:
        prompt = random.choice(self.prompts)
        if self.chat:
            kwargs = {"messages": [{"role": "user", "content": prompt}]}
        else:
            kwargs = {"prompt": prompt}
        request = build_request(**kwargs, max_tokens=self.max_tokens,
                                temperature=self.temperature)  # fmt: skip
        measure_stream(self.client, request, self.environment.events.request.fire,
                       self.timeout_s)  # fmt: skip
