"""Fixtures for the load-testing tools: a real server process with the tiny model, and
the --soak option that turns the soak test on."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from engine.client import SpecserveClient
from tests.server.helpers import ServerProcess


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--soak", default=False):
        return
    skip = pytest.mark.skip(reason="soak test: run with --soak")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


class BenchServer(ServerProcess):
    """`specserve serve` in a process, quiet logs, waited on until it serves."""

    def __init__(self, model_dir: Path, *extra: str) -> None:
        super().__init__(model_dir, "--log-level", "WARNING", *extra)

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
