"""Health while loading, engine failure and graceful drain, against in-process servers."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from engine.client import SpecserveClient
from engine.core.llm_engine import LLMEngine
from tests.server.helpers import InProcessServer, wait_no_blocks_in_use, wait_until

LONG = dict(max_tokens=400, ignore_eos=True, temperature=0.0)


class _Stream(threading.Thread):
    """Consume one Generate stream in a thread; record tokens and the final status."""

    def __init__(self, client: SpecserveClient, **kwargs) -> None:
        super().__init__(daemon=True)
        self.stream = client.generate("Hello world", **kwargs)
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.error: grpc.RpcError | None = None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            for delta in self.stream:
                self.num_tokens += len(delta.token_ids)
                self.finish_reason = delta.finish_reason
                self.started.set()
        except grpc.RpcError as exc:
            self.error = exc
        self.started.set()


def test_not_serving_while_loading_then_serving(engine_config):
    release = threading.Event()

    def slow_factory(config):
        release.wait(30)
        return LLMEngine(config)

    srv = InProcessServer(engine_config, engine_factory=slow_factory).start(wait_ready=False)
    try:
        with SpecserveClient(srv.target) as client:
            assert client.health() == "NOT_SERVING"
            assert client.health("") == "NOT_SERVING"
            for call in (
                lambda: client.generate_complete("Hi", max_tokens=1),
                lambda: client.model_info(),
            ):
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "loading" in info.value.details()
            release.set()
            client.wait_serving(timeout=60)
            assert client.health("") == "SERVING"
            assert len(client.generate_complete("Hi", max_tokens=1).token_ids) == 1
    finally:
        release.set()
        srv.stop()


class _FailingEngine:
    """The real engine, whose step() raises once ``fail`` is set."""

    def __init__(self, inner: LLMEngine, fail: threading.Event) -> None:
        self._inner = inner
        self._fail = fail

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def step(self):
        if self._fail.is_set():
            raise RuntimeError("injected device fault\n  at layer 3\n  (traceback-like)")
        return self._inner.step()


def test_engine_failure_is_internal_one_line_and_not_serving(engine_config):
    fail = threading.Event()
    factory = lambda config: _FailingEngine(LLMEngine(config), fail)  # noqa: E731
    with (
        InProcessServer(engine_config, engine_factory=factory) as srv,
        SpecserveClient(srv.target) as client,
    ):
        streams = [_Stream(client, **LONG) for _ in range(3)]
        for s in streams:
            s.start()
        for s in streams:
            assert s.started.wait(30)
        fail.set()
        for s in streams:
            s.join(30)
            assert s.error is not None, "stream should end with an error"
            assert s.error.code() == grpc.StatusCode.INTERNAL
            details = s.error.details()
            assert "\n" not in details and "injected device fault" in details
            assert "Traceback" not in details
        wait_until(lambda: client.health() == "NOT_SERVING", 5, "health NOT_SERVING")
        assert client.health("") == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as info:
            client.generate_complete("Hi", max_tokens=1)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "\n" not in info.value.details()
        assert "INTERNAL" in srv.errors
        # The last numbers the engine published are not current: no stats, the failure.
        with pytest.raises(grpc.RpcError) as info:
            client.server_stats()
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert info.value.details().startswith("engine failed: ")
        assert "injected device fault" in info.value.details()


def test_graceful_drain_lets_running_streams_finish(engine_config):
    srv = InProcessServer(engine_config).start()
    with SpecserveClient(srv.target) as client:
        streams = [_Stream(client, max_tokens=150, ignore_eos=True) for _ in range(4)]
        for s in streams:
            s.start()
        for s in streams:
            assert s.started.wait(30)
        drained = asyncio.run_coroutine_threadsafe(srv.server.shutdown(30), srv._loop)
        wait_until(lambda: client.health() == "NOT_SERVING", 5, "health NOT_SERVING")
        with pytest.raises(grpc.RpcError) as info:
            client.generate_complete("Hi", max_tokens=1)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        for s in streams:
            s.join(60)
            assert s.error is None and s.finish_reason == "length" and s.num_tokens == 150
        drained.result(30)
    srv.stop()


def test_drain_grace_expiry_ends_streams_unavailable(engine_config):
    srv = InProcessServer(engine_config).start()
    with SpecserveClient(srv.target) as client:
        stream = _Stream(client, max_tokens=500, ignore_eos=True)
        stream.start()
        assert stream.started.wait(30)
        srv.call(srv.server.shutdown(0.2))
        stream.join(30)
        assert stream.error is not None
        assert stream.error.code() == grpc.StatusCode.UNAVAILABLE
    srv.stop()


def test_stats_settle_after_many_cancellations(server: InProcessServer):
    with SpecserveClient(server.target) as client:
        streams = [client.generate("Hello world", **LONG) for _ in range(8)]
        for stream in streams:
            next(iter(stream))
        for stream in streams:
            stream.cancel()
        wait_no_blocks_in_use(client)
