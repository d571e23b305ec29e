"""The specserve.v1.Generation servicer: validate, call AsyncEngine, map errors.

Every handler runs inside ``_call``: exceptions become a status code with a one-line
message (never UNKNOWN), and client cancellation or deadline expiry (grpc.aio cancels
the handler task) closes the engine iterator, which aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import grpc

from engine.errors import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    EngineShutdownError,
)
from engine.rpc import generation_pb2 as pb
from engine.rpc import generation_pb2_grpc as pb_grpc
from engine.server import convert
from engine.server.lifecycle import Lifecycle
from engine.server.validation import (
    EngineRequest,
    InvalidArgument,
    ModelLimits,
    check_tokenize_length,
    to_chat_messages,
    to_engine_request,
)

logger = logging.getLogger(__name__)

RETRY_AFTER_KEY = "retry-after-ms"


class RpcError(Exception):
    """Ends an RPC with ``code``; ``details`` is one line."""

    def __init__(
        self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.trailing = trailing


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(
        self,
        engine: Any,
        lifecycle: Lifecycle,
        report_error: Callable[[grpc.StatusCode, str, str | None], None] = (
            lambda code, details, request_id: None
        ),
    ) -> None:
        self._engine = engine
        self._lifecycle = lifecycle
        # Called with (code, details, request_id or None) for every RPC that fails.
        self._report_error = report_error

    # ---- RPCs --------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        await self._guard(context, self._generate, request, context)

    async def GenerateComplete(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateCompleteResponse:
        return await self._guard(context, self._generate_complete, request)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        return await self._guard(context, self._tokenize, request)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        return await self._guard(context, self._model_info, admit=False)

    async def GetServerStats(
        self, request: pb.GetServerStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerStats:
        return await self._guard(context, self._server_stats, admit=False)

    # ---- handlers (raise; _guard turns exceptions into statuses) -----------------
    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        req = self._validate(request)
        num_completion_tokens = 0
        # aclosing: a cancellation that lands while we wait on context.write must still
        # close the engine iterator, whose finally block aborts the request.
        async with contextlib.aclosing(self._submit(req)) as outputs:
            async for output in outputs:
                num_completion_tokens += len(output.token_ids)
                await context.write(convert.to_response(output, num_completion_tokens))

    async def _generate_complete(self, request: pb.GenerateRequest) -> pb.GenerateCompleteResponse:
        req = self._validate(request)
        async with contextlib.aclosing(self._submit(req)) as outputs:
            collected = [output async for output in outputs]
        request_id = collected[-1].label if collected else (req.request_id or "")
        return convert.to_complete_response(request_id, collected)

    async def _tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        engine = self._ready_engine()
        limits = ModelLimits.from_model_info(engine.model_info)
        kind = request.WhichOneof("input")
        if kind == "text":
            check_tokenize_length("text", len(request.text), limits)
            ids = await engine.tokenize(request.text)
        elif kind == "chat":
            messages = to_chat_messages(request.chat)
            check_tokenize_length("chat", sum(len(m["content"]) for m in messages), limits)
            ids = await engine.tokenize(messages=messages)
        else:
            raise InvalidArgument("input must be set: one of text, chat")
        return pb.TokenizeResponse(token_ids=ids, num_tokens=len(ids))

    async def _model_info(self) -> pb.ModelInfo:
        return convert.to_model_info(self._ready_engine().model_info)

    async def _server_stats(self) -> pb.ServerStats:
        engine = self._engine
        if engine.dead_error is not None:
            # The last numbers the engine published are not current any more.
            raise EngineDeadError(f"engine failed: {_one_line(engine.dead_error)}")
        return convert.to_server_stats(engine.stats, self._lifecycle.num_in_flight)

    # ---- helpers -----------------------------------------------------------------
    def _validate(self, request: pb.GenerateRequest) -> EngineRequest:
        # Cheap checks only: the engine encodes text and chat prompts off this loop,
        # and a template that refuses the messages or a prompt too long for the
        # context comes back from it as a ValueError (INVALID_ARGUMENT).
        engine = self._ready_engine()
        return to_engine_request(request, ModelLimits.from_model_info(engine.model_info))

    def _submit(self, req: EngineRequest):
        return self._engine.generate(
            req.prompt,
            req.params,
            req.request_id,
            priority=req.priority,
            messages=req.messages,
        )

    def _ready_engine(self) -> Any:
        engine = self._engine
        if engine.dead_error is not None:
            raise EngineDeadError(f"engine failed: {_one_line(engine.dead_error)}")
        if not engine.is_ready:
            raise EngineShutdownError("the model is still loading; retry later")
        return engine

    async def _guard(
        self, context: grpc.aio.ServicerContext, handler, *args: Any, admit: bool = True
    ) -> Any:
        """Run ``handler``; any exception ends the RPC with a mapped status, one line."""
        if admit and self._lifecycle.draining:
            error = RpcError(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        else:
            # Only calls that may reach the engine count as in flight (shutdown waits
            # for them); model info and stats calls do not.
            tracking = self._lifecycle.track() if admit else contextlib.nullcontext()
            with tracking:
                try:
                    return await handler(*args)
                except asyncio.CancelledError:
                    self._report_cancelled(context, args)
                    raise
                except Exception as exc:
                    error = self._to_rpc_error(exc)
        if context.done():  # the client is gone: nobody to tell
            return None
        self._report_error(error.code, error.details, _request_id(args))
        if error.trailing:
            context.set_trailing_metadata(error.trailing)
        await context.abort(error.code, error.details)

    def _report_cancelled(self, context: grpc.aio.ServicerContext, args: tuple) -> None:
        """grpc.aio cancels the handler when the client cancels or the deadline passes."""
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"
        else:
            code, details = grpc.StatusCode.CANCELLED, "cancelled by the client"
        self._report_error(code, details, _request_id(args))

    def _to_rpc_error(self, exc: Exception) -> RpcError:
        if isinstance(exc, RpcError):
            return exc
        if isinstance(exc, ValueError):
            return RpcError(grpc.StatusCode.INVALID_ARGUMENT, _one_line(exc))
        if isinstance(exc, EngineOverloadedError):
            retry_ms = str(max(1, int(exc.retry_after_s * 1000)))
            return RpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, _one_line(exc), ((RETRY_AFTER_KEY, retry_ms),)
            )
        if isinstance(exc, EngineShutdownError):
            return RpcError(grpc.StatusCode.UNAVAILABLE, _one_line(exc))
        if isinstance(exc, EngineDeadError):
            return RpcError(grpc.StatusCode.INTERNAL, _one_line(exc))
        logger.error("internal error in handler: %s", _one_line(exc))
        return RpcError(grpc.StatusCode.INTERNAL, f"internal error: {_one_line(exc)}")


def _request_id(args: tuple) -> str | None:
    request = args[0] if args else None
    if isinstance(request, pb.GenerateRequest) and request.HasField("request_id"):
        return request.request_id[:128]
    return None


def _one_line(exc: BaseException) -> str:
    """The message on one line; the type name too where the message alone is not enough."""
    text = " ".join((str(exc) or type(exc).__name__).split())
    if not isinstance(exc, (ValueError, RpcError, EngineError)):
        text = f"{type(exc).__name__}: {text}"
    return text[:500]
