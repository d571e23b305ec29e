"""Fixtures for the operations tests: the shared tiny model and an ngram engine config."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig


@pytest.fixture(scope="session")
def ops_model_dir(request: pytest.FixtureRequest, tmp_path_factory) -> Path:
    """The shared tiny model (tests/conftest.py) if present, else the server tests' one."""
    try:
        return Path(request.getfixturevalue("tiny_model_dir"))
    except pytest.FixtureLookupError:
        from tests.server.tiny_model import build_tiny_model

        return build_tiny_model(tmp_path_factory.mktemp("ops-tiny-model"))


@pytest.fixture(scope="session")
def ngram_config(ops_model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model=str(ops_model_dir), speculative_method="ngram", num_kv_blocks=64, device="cpu"
    )
