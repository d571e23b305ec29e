"""Admission: free running slots plus the waiting limit, recounted the moment a stream
ends. The engine's steps are held at a gate, so nothing here depends on timing."""

from __future__ import annotations

import dataclasses
import threading

import grpc
import pytest

from engine.client import SpecserveClient
from engine.core.llm_engine import LLMEngine
from tests.engine.wrapped_engines import GatedEngine
from tests.server.helpers import InProcessServer, wait_no_blocks_in_use, wait_until

LONG = dict(max_tokens=400, ignore_eos=True, temperature=0.0)


class _Stream(threading.Thread):
    """One Generate call in a thread; records the status it ended with, if any."""

    def __init__(self, client: SpecserveClient, i: int) -> None:
        super().__init__(daemon=True)
        self.call = client.generate([5 + i % 50, 6], **LONG)
        self.error: grpc.RpcError | None = None

    def run(self) -> None:
        try:
            for _ in self.call:
                pass
        except grpc.RpcError as exc:
            self.error = exc

    def refused(self) -> bool:
        return self.error is not None and self.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def _gated_server(engine_config, gate: threading.Event, max_waiting: int) -> InProcessServer:
    config = dataclasses.replace(engine_config, max_num_seqs=4, max_waiting_requests=max_waiting)
    factory = lambda config: GatedEngine(LLMEngine(config), gate)  # noqa: E731
    return InProcessServer(config, engine_factory=factory)


def test_forty_simultaneous_requests_admit_slots_plus_waiting_limit(engine_config):
    gate = threading.Event()
    with _gated_server(engine_config, gate, 4) as srv, SpecserveClient(srv.target) as client:
        streams = [_Stream(client, i) for i in range(40)]
        for stream in streams:
            stream.start()
        wait_until(
            lambda: sum(s.error is not None for s in streams) + srv.engine.num_in_flight == 40,
            30,
            "every request refused or admitted",
        )
        refused = [s for s in streams if s.refused()]
        assert len(refused) == 32 and srv.engine.num_in_flight == 8
        assert "4 requests waiting (limit 4)" in refused[0].error.details()
        for stream in streams:
            stream.call.cancel()
        gate.set()
        wait_no_blocks_in_use(client)


@pytest.mark.parametrize("max_waiting", [4, 8, 32])
def test_after_cancelling_max_waiting_streams_the_next_request_is_admitted(
    engine_config, max_waiting
):
    gate = threading.Event()
    srv = _gated_server(engine_config, gate, max_waiting)
    with srv, SpecserveClient(srv.target) as client:
        streams = [_Stream(client, i) for i in range(max_waiting)]
        for stream in streams:
            stream.start()
        wait_until(lambda: srv.engine.num_in_flight == max_waiting, 30, "all streams admitted")
        for stream in streams:
            stream.call.cancel()
        wait_until(lambda: srv.engine.num_in_flight == 0, 30, "the cancelled streams to end")
        gate.set()
        wait_no_blocks_in_use(client)
        assert client.health() == "SERVING"
        reply = client.generate_complete("Hello", max_tokens=2, ignore_eos=True, timeout=30)
        assert len(reply.token_ids) == 2
        assert "RESOURCE_EXHAUSTED" not in srv.errors
