"""Locust load test for specserve, straight over gRPC or through the Shepherd Model
Gateway's OpenAI HTTP API. The host picks the user class: `--host HOST:PORT` runs
SpecserveUser (gRPC), `--host http[s]://HOST:PORT` runs GatewayUser (OpenAI streaming
chat); naming a class on the command line overrides that.

SpecserveUser streams Generate and reports two events per request (request_type "grpc"):

    "Generate TTFT"  response_time = ms to the first streamed token, response_length 0
    "Generate"       response_time = ms to the end of the stream, response_length = tokens;
                     a failed call is one failure here, with the gRPC status as exception

GatewayUser streams POST /v1/chat/completions (SSE, usage included) and reports the same
pair as "Chat completion TTFT" and "Chat completion" (request_type "http"); the tokens are
the server's usage.completion_tokens, and an HTTP error, an error event or a stream that
ends before `data: [DONE]` is the failure.

    locust -f deploy/loadtest/locustfile.py --host 127.0.0.1:50051 \\
        --headless -u 32 -r 4 -t 2m --csv specserve
    locust -f deploy/loadtest/locustfile.py --host http://127.0.0.1:30000 \\
        --headless -u 32 -r 4 -t 2m --csv gateway

Settings (environment): SPECSERVE_MAX_TOKENS (64), SPECSERVE_TEMPERATURE (0),
SPECSERVE_API_KEY, SPECSERVE_PROMPTS (a JSONL file with a "prompt" per line; default:
the built-in chat prompts), SPECSERVE_CHAT (1: apply the chat template; gRPC only),
SPECSERVE_MODEL (gateway: the model name; default the one /v1/models lists),
SPECSERVE_TIMEOUT_S (60), SPECSERVE_WAIT_S (think time between requests, 0). Needs
specserve importable (pip install specserve, or run from the repository root).
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
from locust import User, constant, events, task  # noqa: E402

try:
    import engine.client  # noqa: F401
except ImportError:  # running from a checkout: deploy/loadtest/ -> repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# After locust, which monkey-patches the standard library with gevent: requests imports
# ssl, and an ssl imported before the patch recurses forever.
import requests  # noqa: E402

from engine.benchmarks.serve_http import SseDecoder  # noqa: E402
from engine.benchmarks.serve_openai import StreamError, parse_chunk  # noqa: E402
from engine.benchmarks.workloads import CHAT_PROMPTS, load_prompts  # noqa: E402
from engine.client import SpecserveClient, build_request  # noqa: E402

REQUEST_TYPE = "grpc"
HTTP_REQUEST_TYPE = "http"


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


# ---- through the gateway: OpenAI HTTP ------------------------------------------------
class HttpError(Exception):
    """A non-200 answer, or a stream that failed or ended before `data: [DONE]`."""


def measure_sse(session: requests.Session, url: str, body: dict, fire, timeout_s) -> None:
    """Stream one chat completion and fire the TTFT and total-time events."""
    start = time.perf_counter()
    num_tokens = num_text_messages = 0
    error: Exception | None = None
    try:
        with session.post(url, json=body, stream=True, timeout=timeout_s) as response:
            if response.status_code != 200:
                raise HttpError(f"HTTP {response.status_code}: {response.text[:200]}")
            decoder, done = SseDecoder(), False
            for piece in response.iter_content(chunk_size=None):  # each piece on arrival
                for data in decoder.feed(piece):
                    if data.strip() == "[DONE]":
                        done = True
                        continue
                    chunk = parse_chunk(data)
                    if chunk.text and num_text_messages == 0:
                        fire(request_type=HTTP_REQUEST_TYPE, name="Chat completion TTFT",
                             response_time=(time.perf_counter() - start) * 1e3,
                             response_length=0, exception=None, context={})  # fmt: skip
                    num_text_messages += bool(chunk.text)
                    num_tokens = chunk.completion_tokens or num_tokens
            if not done:
                raise HttpError("the stream ended before [DONE]")
    except (requests.RequestException, HttpError, StreamError) as exc:
        error = exc
    fire(request_type=HTTP_REQUEST_TYPE, name="Chat completion",
         response_time=(time.perf_counter() - start) * 1e3,
         response_length=num_tokens or num_text_messages, exception=error,
         context={})  # fmt: skip


def _base_url(host: str | None) -> str:
    if not host or not host.startswith(("http://", "https://")):
        raise ValueError("give the gateway with --host http://HOST:PORT")
    base = host.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


class GatewayUser(User):
    """OpenAI streaming chat through the Shepherd Model Gateway (or any OpenAI server)."""

    wait_time = constant(float(os.environ.get("SPECSERVE_WAIT_S", "0")))

    def on_start(self) -> None:
        self.base_url = _base_url(self.host or self.environment.host)
        self.session = requests.Session()
        api_key = os.environ.get("SPECSERVE_API_KEY")
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout_s = float(os.environ.get("SPECSERVE_TIMEOUT_S", "60"))
        self.model = os.environ.get("SPECSERVE_MODEL") or self._served_model()
        self.prompts = _prompts()
        self.max_tokens = int(os.environ.get("SPECSERVE_MAX_TOKENS", "64"))
        self.temperature = float(os.environ.get("SPECSERVE_TEMPERATURE", "0"))

    def _served_model(self) -> str:
        response = self.session.get(f"{self.base_url}/v1/models", timeout=self.timeout_s)
        response.raise_for_status()
        return response.json()["data"][0]["id"]

    def on_stop(self) -> None:
        self.session.close()

    @task
    def chat(self) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": random.choice(self.prompts)}],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        measure_sse(self.session, f"{self.base_url}/v1/chat/completions", body,
                    self.environment.events.request.fire, self.timeout_s)  # fmt: skip


@events.init.add_listener
def _one_protocol_per_host(environment, **_kwargs) -> None:
    """Without a class named on the command line both classes would run, half of them
    against a host of the wrong protocol: keep the one the host's scheme asks for."""
    host = environment.host or ""
    wanted = GatewayUser if host.startswith(("http://", "https://")) else SpecserveUser
    if wanted in environment.user_classes and len(environment.user_classes) > 1:
        environment.user_classes[:] = [wanted]
