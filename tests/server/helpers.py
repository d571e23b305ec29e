"""Test harness: an in-process server on a background event loop, and a server process."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.client import SpecserveClient
from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.server.app import ServerOptions, SpecserveServer

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def fastest_s(run: Callable[[], object], repeats: int = 3) -> float:
    """The fastest of ``repeats`` timings of ``run()``: on a loaded machine the others
    include time the process spent waiting for a core."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times)


def wait_no_blocks_in_use(client: SpecserveClient, timeout_s: float = 10.0) -> None:
    """Poll the stats RPC until no KV block is held (a bounded wait, not a sleep)."""

    def idle() -> bool:
        stats = client.server_stats(timeout=5)
        return stats.target_pool.num_blocks_in_use == 0 and stats.num_in_flight == 0

    wait_until(idle, timeout_s, "KV blocks in use to return to 0")


def assert_still_serving(server: InProcessServer) -> None:
    """After a storm of hostile requests: health SERVING, a normal request served, no
    KV block held, and no RPC ended UNKNOWN or INTERNAL."""
    with SpecserveClient(server.target) as client:
        assert client.health() == "SERVING"
        assert len(client.generate_complete("Hello", max_tokens=3, ignore_eos=True).token_ids) == 3
        wait_no_blocks_in_use(client)
    assert "INTERNAL" not in server.errors and "UNKNOWN" not in server.errors


class PacedEngine:
    """The real engine whose every step() first sleeps ``min_step_s``: a request of N
    steps takes N * min_step_s or more however fast the CPU is, so a test can set a
    deadline that passes mid-request without timing the machine."""

    def __init__(self, inner: Any, min_step_s: float) -> None:
        self._inner = inner
        self._min_step_s = min_step_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def step(self):
        time.sleep(self._min_step_s)
        return self._inner.step()


class InProcessServer:
    """A SpecserveServer running on its own event loop in a daemon thread."""

    def __init__(
        self,
        config: EngineConfig,
        options: ServerOptions | None = None,
        engine_factory: Callable[[EngineConfig], Any] | None = None,
    ) -> None:
        self.engine = AsyncEngine(config, engine_factory=engine_factory)
        self.options = options or ServerOptions(host="127.0.0.1", port=0)
        self.server = SpecserveServer(self.engine, self.options)
        self.errors: list[str] = []
        self.server.on_rpc_error = self.errors.append
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def start(self, wait_ready: bool = True) -> InProcessServer:
        self._thread.start()
        self.call(self.server.start())
        if wait_ready:
            self.call(self.server.wait_ready(60))
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def call(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self, grace_s: float = 1.0) -> None:
        self.call(self.server.shutdown(grace_s))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> InProcessServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ServerProcess:
    """``python -m engine serve ...`` (that is, ``specserve serve``) on a free port.

    One torch thread: on a 2-core machine the server and the test process would both
    spin OpenMP threads and thrash. Output goes to a file, not a pipe: nobody reads a
    pipe while a test runs, and a full pipe would block the server's logging.
    """

    def __init__(
        self,
        model_dir: Path,
        *extra: str,
        port: int | None = None,
        metrics_port: int | None = None,
    ) -> None:
        # Given ports: a server restarted where another one was.
        self.port = port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.args = [
            sys.executable, "-m", "engine", "serve",
            "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(self.port),
            "--metrics-port", str(self.metrics_port),
            "--device", "cpu", "--num-kv-blocks", "512", "--num-threads", "1", *extra,
        ]  # fmt: skip
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives with the process)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            self.args, cwd=REPO_ROOT, env=env, stdout=self.log,
            stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        return self

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def sigterm(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float = 60) -> tuple[int, str]:
        assert self.proc is not None
        self.proc.wait(timeout=timeout_s)
        return self.proc.returncode, self.output()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
