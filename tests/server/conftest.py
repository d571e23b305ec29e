"""Fixtures for the gRPC server tests: the tiny model and one shared in-process server."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.client import SpecserveClient
from engine.config import EngineConfig
from tests.server.helpers import InProcessServer


@pytest.fixture(scope="session")
def model_dir(tiny_model_dir) -> Path:
    """The shared tiny random Llama with a chat template (tests/conftest.py)."""
    return Path(tiny_model_dir)


@pytest.fixture(scope="session")
def engine_config(model_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=512)


@pytest.fixture(scope="module")
def server(engine_config: EngineConfig):
    """One in-process server with the real engine, shared by a test module."""
    with InProcessServer(engine_config) as srv:
        yield srv


@pytest.fixture()
def client(server: InProcessServer):
    with SpecserveClient(server.target) as c:
        yield c
