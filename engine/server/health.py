"""grpc.health.v1 status that follows the engine: loading, serving, failed, draining."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from grpc_health.v1 import health, health_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from engine.rpc import generation_pb2 as pb

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
VLLM_SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
SERVICE_NAMES = ("", SERVICE_NAME, VLLM_SERVICE_NAME)
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _HealthServicer(health.aio.HealthServicer):
    """grpc's aio servicer plus List, which it leaves to the generated base class: a sync
    method that answers UNIMPLEMENTED and logs an ERROR with a traceback for every call."""

    async def List(self, request, context) -> health_pb2.HealthListResponse:
        statuses = {
            name: health_pb2.HealthCheckResponse(status=status)
            for name, status in self._server_status.items()
        }
        return health_pb2.HealthListResponse(statuses=statuses)


class HealthReporter:
    """Owns the health servicer; ``watch`` polls the engine and flips the status."""

    def __init__(self, engine: Any, poll_interval_s: float = 0.1) -> None:
        self.servicer = _HealthServicer()
        self._engine = engine
        self._poll_interval_s = poll_interval_s
        self._serving: bool | None = None
        self._reported_failure = False

    async def start(self) -> None:
        """Register every service name as NOT_SERVING before the server accepts calls."""
        await self._set(False)

    async def watch(self) -> None:
        """Run until cancelled; NOT_SERVING until the model is loaded and after a failure."""
        while True:
            await self.update()
            await asyncio.sleep(self._poll_interval_s)

    async def update(self) -> None:
        """Set the status from the engine's state now."""
        await self._set(self._engine.is_ready and self._engine.is_healthy)
        error = self._engine.dead_error
        if error is not None and not self._reported_failure:
            self._reported_failure = True
            reason = " ".join(str(error).split())[:300]
            logger.error("engine failed, health NOT_SERVING: %s: %s", type(error).__name__, reason)

    async def enter_shutdown(self) -> None:
        """NOT_SERVING for good: later ``_set`` calls are ignored by the servicer."""
        await self.servicer.enter_graceful_shutdown()

    async def _set(self, serving: bool) -> None:
        if serving == self._serving:
            return
        self._serving = serving
        for name in SERVICE_NAMES:
            await self.servicer.set(name, _SERVING if serving else _NOT_SERVING)
