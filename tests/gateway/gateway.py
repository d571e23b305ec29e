"""The real Shepherd Model Gateway (PyPI ``smg``, a test extra) in a subprocess on free
ports, in front of specserve workers (``--backend vllm``), and a small HTTP client."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.server.helpers import free_port


def smg_path() -> str:
    path = shutil.which("smg", path=str(Path(sys.executable).parent))
    if path is None:  # a test extra (pyproject.toml): install it with .[test]
        pytest.fail("the smg gateway is not installed next to this Python (pip install smg)")
    return path


class Gateway:
    """``smg launch`` against ``worker_targets``; its output goes to a file. Without
    ``model_dir`` the gateway takes the tokenizer from the workers."""

    def __init__(self, worker_targets: list[str], model_dir: str | None, *extra: str) -> None:
        self.model = model_dir  # the gateway names the model by its path
        self.port = free_port()
        self.metrics_port = free_port()
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives with the process)
        urls = [f"grpc://{target}" for target in worker_targets]
        args = [
            smg_path(), "launch", "--backend", "vllm", "--worker-urls", *urls,
            *(["--model-path", model_dir] if model_dir else []),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
            "--log-level", "warn", *extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url(path), timeout=10) as response:
            return json.loads(response.read())

    def post(self, path: str, body: dict):
        """The open response (a context manager); HTTP errors fail the test."""
        request = urllib.request.Request(
            self.url(path), json.dumps(body).encode(), {"content-type": "application/json"}
        )
        try:
            return urllib.request.urlopen(request, timeout=60)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path}: HTTP {exc.code}: {exc.read()[:500]!r}") from None

    def post_json(self, path: str, body: dict) -> tuple[dict, str]:
        """(reply, the worker the gateway routed it to)."""
        with self.post(path, body) as response:
            return json.loads(response.read()), response.headers["x-smg-routed-worker-id"]

    def stream(self, path: str, body: dict) -> list[dict]:
        """The SSE events of a streamed request, [DONE] checked and dropped."""
        events = []
        with self.post(path, {**body, "stream": True}) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response:
                line = line.decode().strip()
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]

    def open_stream(self, path: str, body: dict) -> socket.socket:
        """A raw HTTP/1.1 streamed request: the caller reads a little and hangs up."""
        payload = json.dumps({**body, "stream": True}).encode()
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n\r\n"
        )
        sock.sendall(head.encode() + payload)
        return sock

    def num_healthy_workers(self) -> int:
        if self.proc.poll() is not None:
            raise AssertionError(f"smg exited {self.proc.returncode}:\n{self.output()[-3000:]}")
        try:
            return self.get("/readiness").get("healthy_workers", 0)
        except urllib.error.HTTPError as exc:  # 503 until a worker is healthy
            return json.loads(exc.read() or b"{}").get("healthy_workers", 0)
        except (OSError, ValueError):
            return 0

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
