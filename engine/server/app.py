"""SpecserveServer: the grpc.aio server around one AsyncEngine.

It serves specserve.v1.Generation and vllm.grpc.engine.VllmEngine (for the Shepherd
Model Gateway) on one port, behind one API-key check, one decode guard and one
``RpcGuard`` (drain, error mapping, error hooks).

Lifecycle: ``start()`` binds the port and answers health NOT_SERVING while the model
loads; health turns SERVING when the engine is ready. ``shutdown()`` drains: health
NOT_SERVING, new generation calls UNAVAILABLE, KV-event subscriptions end, running
streams get ``shutdown_grace_s`` to finish, then the engine stops and whatever is left
ends UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from engine.rpc import generation_pb2_grpc as pb_grpc
from engine.server.auth import ApiKeyInterceptor, server_credentials
from engine.server.decode_guard import DecodeGuardInterceptor
from engine.server.health import SERVICE_NAME, VLLM_SERVICE_NAME, HealthReporter
from engine.server.lifecycle import Lifecycle
from engine.server.ports import ensure_port_free
from engine.server.rpc_guard import RpcGuard
from engine.server.servicer import GenerationServicer
from engine.server.vllm_kv_events import KvEventHub
from engine.server.vllm_servicer import VllmEngineServicer

logger = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass(frozen=True)
class ServerOptions:
    host: str = "0.0.0.0"
    port: int = 50051  # 0 picks a free port (see SpecserveServer.port)
    reflection: bool = True
    shutdown_grace_s: float = 30.0
    # One key, or several (one caller each: Abort reaches only the caller's own labels).
    api_key: str | tuple[str, ...] | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    max_message_mib: int = 16
    # Server pings idle connections this often to find dead peers.
    keepalive_time_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    # Clients may ping at most this often (faster pings get the connection closed).
    min_client_ping_interval_s: float = 10.0
    # GOAWAY after this long so long-lived clients reconnect and rebalance across pods.
    max_connection_age_s: float = 300.0
    max_connection_age_grace_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if not 1 <= self.max_message_mib <= 1024:
            raise ValueError(f"max_message_mib must be in [1, 1024], got {self.max_message_mib}")
        for name in (
            "keepalive_time_s",
            "keepalive_timeout_s",
            "min_client_ping_interval_s",
            "max_connection_age_s",
            "max_connection_age_grace_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def grpc_options(self) -> list[tuple[str, int]]:
        ms = 1000
        return [
            ("grpc.max_send_message_length", self.max_message_mib * MiB),
            ("grpc.max_receive_message_length", self.max_message_mib * MiB),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * ms)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * ms)),
            ("grpc.keepalive_permit_without_calls", 1),
            (
                "grpc.http2.min_ping_interval_without_data_ms",
                int(self.min_client_ping_interval_s * ms),
            ),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.max_connection_age_ms", int(self.max_connection_age_s * ms)),
            ("grpc.max_connection_age_grace_ms", int(self.max_connection_age_grace_s * ms)),
            # grpc's default (1) lets a second server share a busy port: refuse instead.
            ("grpc.so_reuseport", 0),
        ]

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"


class SpecserveServer:
    """One grpc.aio server serving one AsyncEngine. Create and run it inside an event loop."""

    def __init__(self, engine: Any, options: ServerOptions) -> None:
        self.engine = engine
        self.options = options
        self.port: int | None = None
        # Observability hooks (engine/observability/: metrics.py, request_log.py), all optional.
        # Every RPC that does not end OK: its status code name ("INVALID_ARGUMENT", ...).
        self.on_rpc_error: Callable[[str], None] | None = None
        # The same, with the one-line details and the caller's request_id if it sent one.
        self.on_rpc_failure: Callable[[str, str, str | None], None] | None = None
        # A request refused because the waiting queue was full (RESOURCE_EXHAUSTED).
        self.on_admission_rejected: Callable[[], None] | None = None
        self.lifecycle = Lifecycle()
        self.health = HealthReporter(engine)
        # The target pool's prefix-cache events, for VllmEngine.SubscribeKvEvents.
        self.kv_events = KvEventHub()
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopped = asyncio.Event()

    async def start(self) -> int:
        """Bind, start answering (health NOT_SERVING), start loading the model."""
        ensure_port_free(self.options.host, self.options.port)
        # The first interceptor is the outermost: the API key is checked before the body.
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if self.options.api_key:
            interceptors.append(ApiKeyInterceptor(self.options.api_key, self._report_error))
        interceptors.append(DecodeGuardInterceptor(self._report_error, self._max_prompt_ids))
        server = grpc.aio.server(interceptors=interceptors, options=self.options.grpc_options())
        guard = RpcGuard(self.lifecycle, self._report_error)
        pb_grpc.add_GenerationServicer_to_server(GenerationServicer(self.engine, guard), server)
        vpb_grpc.add_VllmEngineServicer_to_server(
            VllmEngineServicer(self.engine, guard, self.kv_events), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        if self.options.reflection:
            names = (
                SERVICE_NAME,
                VLLM_SERVICE_NAME,
                "grpc.health.v1.Health",
                reflection.SERVICE_NAME,
            )
            reflection.enable_server_reflection(names, server)
        self.port = self._bind(server)
        await self.health.start()
        await server.start()
        self._server = server
        # Before the engine starts: the hub must see every event from the first step.
        self.kv_events.attach(asyncio.get_running_loop())
        self.engine.kv_event_listener = self.kv_events.publish_threadsafe
        self.engine.start()
        self._tasks.append(asyncio.create_task(self.health.watch(), name="health-watch"))
        return self.port

    def _bind(self, server: grpc.aio.Server) -> int:
        credentials = server_credentials(
            self.options.tls_cert, self.options.tls_key, self.options.tls_client_ca
        )
        try:
            if credentials is None:
                port = server.add_insecure_port(self.options.address)
            else:
                port = server.add_secure_port(self.options.address, credentials)
        except RuntimeError as exc:  # grpc says only "Failed to bind to address ..."
            ensure_port_free(self.options.host, self.options.port)  # taken after the probe?
            raise OSError(f"could not bind {self.options.address}: {exc}") from None
        if not port:
            raise OSError(f"could not bind {self.options.address}")
        return port

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Until the model is loaded; raises EngineDeadError if loading failed."""
        await self.engine.wait_ready(timeout_s)
        await self.health.update()

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Drain and stop. Safe to call more than once."""
        if self.lifecycle.draining:
            await self._stopped.wait()
            return
        grace_s = self.options.shutdown_grace_s if grace_s is None else grace_s
        self.lifecycle.draining = True
        await self.health.enter_shutdown()
        finished = await self.lifecycle.wait_idle(grace_s)
        if not finished:
            logger.warning(
                "shutdown grace of %.0fs ran out with %d calls in flight",
                grace_s,
                self.lifecycle.num_in_flight,
            )
        # Ends the streams still running with EngineShutdownError -> UNAVAILABLE.
        await asyncio.to_thread(self.engine.shutdown)
        await self.lifecycle.wait_idle(1.0)
        for task in self._tasks:
            task.cancel()
        if self._server is not None:
            await self._server.stop(grace=0.5)
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def _max_prompt_ids(self) -> int | None:
        """Validation keeps at most max_model_len - 1 prompt ids; None while loading."""
        max_model_len = self.engine.model_info.get("max_model_len")
        return int(max_model_len) if max_model_len else None

    def _report_error(self, code: grpc.StatusCode, details: str, request_id: str | None) -> None:
        calls: list[tuple[Callable | None, tuple]] = [
            (self.on_rpc_error, (code.name,)),
            (self.on_rpc_failure, (code.name, details, request_id)),
        ]
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            calls.append((self.on_admission_rejected, ()))
        for hook, args in calls:
            if hook is None:
                continue
            try:
                hook(*args)
            except Exception as exc:  # an observability bug must not break the RPC path
                logger.error("observability hook failed: %s: %s", type(exc).__name__, exc)
