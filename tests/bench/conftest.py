"""Fixtures for the load-testing tools: a real server process with the tiny model, and
the --soak option that turns the soak test on."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from engine.client import SpecserveClient
from tests.server.helpers import REPO_ROOT, ServerProcess


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", default=False,
                     help="run the soak tests (marker 'soak'; minutes, not seconds)")  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--soak", default=False):
        return
    skip = pytest.mark.skip(reason="soak test: run with --soak")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


class BenchServer(ServerProcess):
    """`specserve serve` in a process, one torch thread (2-core CI machines thrash when
    the server and the load generator both spin OpenMP threads)."""

    def __init__(self, model_dir: Path, *extra: str) -> None:
        super().__init__(model_dir, "--num-threads", "1", "--log-level", "WARNING", *extra)
        # The `specserve serve` entry point, then the helper's flags from --model on.
        self.args = [sys.executable, "-m", "engine.cli", "serve",
                     *self.args[self.args.index("--model"):]]  # fmt: skip
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives with the process)

    def start(self) -> BenchServer:
        # Output to a file, not a pipe: nobody reads a pipe during a load test, and a
        # full pipe would block the server's logging.
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(self.args, cwd=REPO_ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, text=True)  # fmt: skip
        return self

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def start_serving(self, timeout_s: float = 90) -> BenchServer:
        self.start()
        with SpecserveClient(self.target) as client:
            deadline = time.monotonic() + timeout_s
            while not self._serving(client):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"server did not start:\n{self.output()[-3000:]}")
                time.sleep(0.1)
        return self

    @staticmethod
    def _serving(client: SpecserveClient) -> bool:
        try:
            return client.health(timeout=1.0) == "SERVING"
        except grpc.RpcError:
            return False

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


@pytest.fixture(scope="session")
def bench_server(tiny_model_dir):
    server = BenchServer(Path(tiny_model_dir)).start_serving()
    yield server
    server.kill()
