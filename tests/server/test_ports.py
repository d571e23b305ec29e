"""`specserve serve` refuses a port another process holds (gRPC and metrics) with one
line naming the port and the flag, before the model loads; the other server keeps it."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.observability.metrics import EngineMetrics
from engine.server.app import ServerOptions, SpecserveServer
from engine.server.ports import PortInUseError, ensure_port_free
from tests.server.helpers import REPO_ROOT, free_port


def _serve(model_dir: Path, port: int, metrics_port: int) -> subprocess.CompletedProcess:
    """``specserve serve`` to completion: it must refuse, so a bound wait is a failure."""
    args = [
        sys.executable, "-m", "engine", "serve", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port),
        "--device", "cpu", "--num-kv-blocks", "64", "--num-threads", "1",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=90)


def _old_style_grpc_server() -> tuple[grpc.Server, int]:
    """A grpc server with grpc's default SO_REUSEPORT, as any other grpc server (or
    specserve before the fix) binds: a second such server would share its port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def _health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_serve_refuses_a_grpc_port_in_use(model_dir):
    holder, port = _old_style_grpc_server()
    try:
        done = _serve(model_dir, port, 0)
        assert done.returncode == 2, done.stderr
        expected = (
            f"specserve serve: error: port {port} is already in use (--port); "
            "stop the other server or pick another port"
        )
        assert done.stderr.splitlines() == [expected]
        assert done.stdout == ""
        assert _health(port) == health_pb2.HealthCheckResponse.SERVING
    finally:
        holder.stop(0)


def test_serve_refuses_a_metrics_port_in_use(model_dir):
    holder = EngineMetrics()
    metrics_port = holder.start_http_server(0, addr="127.0.0.1")
    try:
        done = _serve(model_dir, free_port(), metrics_port)
        assert done.returncode == 2, done.stderr
        expected = (
            f"specserve serve: error: port {metrics_port} is already in use (--metrics-port); "
            "stop the other server or pick another port"
        )
        assert done.stderr.splitlines() == [expected]
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
    finally:
        holder.stop_http_server()


def test_server_start_refuses_before_touching_the_engine(engine_config):
    """In process: PortInUseError from start(), and the engine is never started."""

    class _Engine:
        started = False

        def start(self) -> None:
            self.started = True

    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        engine = _Engine()
        server = SpecserveServer(engine, ServerOptions(host="127.0.0.1", port=port))
        with pytest.raises(PortInUseError, match=f"port {port} is already in use"):
            asyncio.run(server.start())
        assert not engine.started
        with pytest.raises(PortInUseError):
            ensure_port_free("0.0.0.0", port)  # the wildcard address overlaps it too
    ensure_port_free("127.0.0.1", port)  # free again once the holder is closed
    ensure_port_free("127.0.0.1", 0)


def test_grpc_options_turn_port_sharing_off():
    assert ("grpc.so_reuseport", 0) in ServerOptions().grpc_options()
