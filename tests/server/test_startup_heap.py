"""`specserve serve` freezes its start-up heap before it reports ready: the model,
tokenizer and modules move to the collector's permanent generation, so a full
collection while serving does not scan them (a 180 ms pause with the default model);
a plain AsyncEngine (a library user's) never freezes anything."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import re
import signal

import pytest

from engine.client import SpecserveClient
from engine.core.async_engine import AsyncEngine
from engine.io.sampling_params import SamplingParams
from engine.server import main
from engine.server.app import ServerOptions


@pytest.fixture(autouse=True)
def _nothing_frozen():
    gc.unfreeze()
    yield
    gc.unfreeze()  # the frozen objects go back to the oldest generation, collectable


def test_serve_freezes_the_startup_heap_before_ready_and_still_serves(engine_config, caplog):
    caplog.set_level(logging.INFO, logger="engine.core.async_engine")
    seen: dict = {}

    def setup(server) -> None:
        async def once_ready() -> None:
            await server.wait_ready()
            seen["frozen"] = gc.get_freeze_count()
            # the engine the loop built is frozen: no generation tracks it any more
            engine = server.engine._engine
            seen["tracked"] = any(obj is engine for obj in gc.get_objects())
            target = f"127.0.0.1:{server.port}"
            with SpecserveClient(target) as client:
                reply = await asyncio.to_thread(
                    client.generate_complete, "Hello", max_tokens=4, ignore_eos=True, timeout=30
                )
            seen["tokens"] = len(reply.token_ids)
            os.kill(os.getpid(), signal.SIGTERM)

        seen["task"] = asyncio.get_running_loop().create_task(once_ready())

    options = ServerOptions(host="127.0.0.1", port=0, shutdown_grace_s=1.0)
    assert main.serve(engine_config, options, setup) == 0
    assert seen["task"].exception() is None
    assert seen["frozen"] > 1000
    assert seen["tracked"] is False
    assert seen["tokens"] == 4
    # the one line operations.md quotes, with the count gc reported at the freeze (frozen
    # objects freed since by their reference counts leave the permanent generation)
    [line] = [r.getMessage() for r in caplog.records if "start-up heap frozen" in r.getMessage()]
    logged = int(re.fullmatch(r"start-up heap frozen: (\d+) objects the garbage collector skips",
                              line).group(1))  # fmt: skip
    assert logged >= seen["frozen"]


def test_a_plain_async_engine_freezes_nothing(engine_config):
    async def run() -> None:
        engine = AsyncEngine(engine_config)
        engine.start()
        await engine.wait_ready(60)
        try:
            params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
            tokens = [t async for out in engine.generate([5, 6, 7], params) for t in out.token_ids]
            assert len(tokens) == 3
            assert gc.get_freeze_count() == 0
            assert any(obj is engine._engine for obj in gc.get_objects())
        finally:
            engine.shutdown()

    asyncio.run(run())
