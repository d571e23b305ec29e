"""What every RPC handler of every service runs inside: drain refusal, in-flight
accounting, exception -> status mapping (one line, never UNKNOWN) and error reporting.

Client cancellation and deadline expiry reach a handler as ``CancelledError`` (grpc.aio
cancels its task); they are reported and re-raised, so ``aclosing`` blocks around engine
iterators still run and abort the requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from engine.errors import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    EngineShutdownError,
    ModelOutputError,
)
from engine.server.lifecycle import Lifecycle

logger = logging.getLogger(__name__)

RETRY_AFTER_KEY = "retry-after-ms"
# A client's own deadline timer usually fires a few ms before ours and cancels the call:
# a cancellation this close to the deadline is the deadline.
DEADLINE_SLACK_S = 0.1

# (code, one-line details, the caller's request id or None) for every RPC that fails.
ReportError = Callable[[grpc.StatusCode, str, str | None], None]


class RpcError(Exception):
    """Ends an RPC with ``code``; ``details`` is one line."""

    def __init__(
        self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.trailing = trailing


class RpcGuard:
    """Runs handlers for one server: shared by every servicer on it."""

    def __init__(
        self,
        lifecycle: Lifecycle,
        report_error: ReportError = lambda code, details, request_id: None,
    ) -> None:
        self.lifecycle = lifecycle
        self._report_error = report_error

    async def run(
        self,
        context: grpc.aio.ServicerContext,
        handler: Callable[..., Awaitable[Any]],
        *args: Any,
        admit: bool = True,
        request_id: str | None = None,
    ) -> Any:
        """Run ``handler(*args)``; any exception ends the RPC with a mapped status.

        ``admit``: the call may reach the engine, so it is refused while draining and
        shutdown waits for it. ``request_id`` labels the call in error reports."""
        if admit and self.lifecycle.draining:
            error = RpcError(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        else:
            tracking = self.lifecycle.track() if admit else contextlib.nullcontext()
            with tracking:
                try:
                    return await handler(*args)
                except asyncio.CancelledError:
                    self._report_cancelled(context, request_id)
                    raise
                except Exception as exc:
                    error = to_rpc_error(exc)
        if context.done():  # the client is gone: nobody to tell
            return None
        self._report_error(error.code, error.details, request_id)
        if error.trailing:
            context.set_trailing_metadata(error.trailing)
        await context.abort(error.code, error.details)

    def _report_cancelled(self, context: grpc.aio.ServicerContext, request_id: str | None) -> None:
        remaining = context.time_remaining()
        if remaining is not None and remaining <= DEADLINE_SLACK_S:
            code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"
        else:
            code, details = grpc.StatusCode.CANCELLED, "cancelled by the client"
        self._report_error(code, details, request_id)


def to_rpc_error(exc: Exception) -> RpcError:
    if isinstance(exc, RpcError):
        return exc
    if isinstance(exc, ValueError):
        return RpcError(grpc.StatusCode.INVALID_ARGUMENT, one_line(exc))
    if isinstance(exc, EngineOverloadedError):
        retry_ms = str(max(1, int(exc.retry_after_s * 1000)))
        return RpcError(
            grpc.StatusCode.RESOURCE_EXHAUSTED, one_line(exc), ((RETRY_AFTER_KEY, retry_ms),)
        )
    if isinstance(exc, EngineShutdownError):
        return RpcError(grpc.StatusCode.UNAVAILABLE, one_line(exc))
    if isinstance(exc, EngineDeadError):
        return RpcError(grpc.StatusCode.INTERNAL, one_line(exc))
    if isinstance(exc, ModelOutputError):
        logger.error("a request ended by its model: %s", one_line(exc))
        return RpcError(grpc.StatusCode.INTERNAL, one_line(exc))
    logger.error("internal error in handler: %s", one_line(exc))
    return RpcError(grpc.StatusCode.INTERNAL, f"internal error: {one_line(exc)}")


def ready_engine(engine: Any) -> Any:
    """``engine`` when it serves; EngineDeadError / EngineShutdownError otherwise."""
    if engine.dead_error is not None:
        raise EngineDeadError(f"engine failed: {one_line(engine.dead_error)}")
    if not engine.is_ready:
        raise EngineShutdownError("the model is still loading; retry later")
    return engine


def one_line(exc: BaseException) -> str:
    """The message on one line; the type name too where the message alone is not enough."""
    text = " ".join((str(exc) or type(exc).__name__).split())
    if not isinstance(exc, (ValueError, RpcError, EngineError)):
        text = f"{type(exc).__name__}: {text}"
    return text[:500]
