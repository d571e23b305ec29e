"""Smoke test: the real Shepherd Model Gateway (PyPI ``smg``) starts against a specserve
worker (``--backend vllm``) and serves OpenAI chat completions, plain and SSE, with the
worker's own greedy text. The full gateway suite lives elsewhere; this one is quick."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from engine.client import SpecserveClient
from tests.server.helpers import InProcessServer, free_port, wait_until

MESSAGES = [{"role": "user", "content": "Hello there"}]
BODY = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def _smg() -> str:
    path = shutil.which("smg", path=str(Path(sys.executable).parent))
    if path is None:  # a test extra (pyproject.toml): install it with .[test]
        pytest.fail("the smg gateway is not installed next to this Python (pip install smg)")
    return path


class Gateway:
    """``smg launch`` in a subprocess on free ports; its output goes to a file."""

    def __init__(self, worker_target: str, model_dir: str) -> None:
        self.model = model_dir  # the gateway names the model by its path
        self.port = free_port()
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives with the process)
        args = [
            _smg(), "launch", "--backend", "vllm",
            "--worker-urls", f"grpc://{worker_target}", "--model-path", model_dir,
            "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--log-level", "warn",
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url(path), timeout=10) as response:
            return json.loads(response.read())

    def post(self, path: str, body: dict):
        request = urllib.request.Request(
            self.url(path), json.dumps(body).encode(), {"content-type": "application/json"}
        )
        try:
            return urllib.request.urlopen(request, timeout=60)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path}: HTTP {exc.code}: {exc.read()[:500]!r}") from None

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"smg exited {self.proc.returncode}:\n{self.output()[-3000:]}")
        try:
            return self.get("/readiness").get("healthy_workers", 0) >= 1
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def gateway(server: InProcessServer, model_dir):
    gw = Gateway(server.target, str(model_dir))
    try:
        wait_until(gw.ready, 60, "the gateway to register the specserve worker")
        yield gw
    finally:
        gw.stop()


def _expected(server: InProcessServer) -> tuple[int, str]:
    """(prompt tokens, greedy text) of BODY from specserve's own service."""
    with SpecserveClient(server.target) as client:
        prompt_ids = client.tokenize(messages=MESSAGES)
        reply = client.generate_complete(
            messages=MESSAGES, max_tokens=8, temperature=0.0, ignore_eos=True
        )
    return len(prompt_ids), reply.text


def test_models_lists_the_worker_model(gateway: Gateway, model_dir):
    (model,) = gateway.get("/v1/models")["data"]
    assert model["id"] == str(model_dir)


def test_chat_completion(gateway: Gateway, server: InProcessServer):
    with gateway.post("/v1/chat/completions", {**BODY, "model": gateway.model}) as response:
        assert response.status == 200
        reply = json.loads(response.read())
    num_prompt_tokens, text = _expected(server)
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == text
    assert reply["usage"]["prompt_tokens"] == num_prompt_tokens
    assert reply["usage"]["completion_tokens"] == 8


def test_streamed_chat_completion(gateway: Gateway, server: InProcessServer):
    body = {**BODY, "model": gateway.model, "stream": True}
    body["stream_options"] = {"include_usage": True}
    events = []
    with gateway.post("/v1/chat/completions", body) as response:
        assert response.status == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response:
            line = line.decode().strip()
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    num_prompt_tokens, text = _expected(server)
    assert "".join(d.get("content") or "" for d in deltas) == text
    assert finish[-1] == "length"
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 8 and usage["prompt_tokens"] == num_prompt_tokens
    assert not {"UNKNOWN", "INTERNAL"} & set(server.errors)
