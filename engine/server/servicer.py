"""The specserve.v1.Generation servicer: validate, call AsyncEngine, map errors.

Every handler runs inside ``RpcGuard.run`` (rpc_guard.py): exceptions become a status
code with a one-line message (never UNKNOWN), and client cancellation or deadline expiry
(grpc.aio cancels the handler task) closes the engine iterator, which aborts the request.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import grpc

from engine.errors import EngineDeadError
from engine.rpc import generation_pb2 as pb
from engine.rpc import generation_pb2_grpc as pb_grpc
from engine.server import convert
from engine.server.auth import caller_id
from engine.server.rpc_guard import RpcGuard, one_line, ready_engine
from engine.server.validation import (
    EngineRequest,
    InvalidArgument,
    ModelLimits,
    check_tokenize_length,
    to_chat_messages,
    to_engine_request,
)

logger = logging.getLogger(__name__)


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, engine: Any, guard: RpcGuard) -> None:
        self._engine = engine
        self._guard = guard
        self._lifecycle = guard.lifecycle

    # ---- RPCs --------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        await self._guard.run(
            context, self._generate, request, context, request_id=_request_id(request)
        )

    async def GenerateComplete(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateCompleteResponse:
        return await self._guard.run(
            context, self._generate_complete, request, request_id=_request_id(request)
        )

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        return await self._guard.run(context, self._tokenize, request)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        return await self._guard.run(context, self._model_info, admit=False)

    async def GetServerStats(
        self, request: pb.GetServerStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerStats:
        return await self._guard.run(context, self._server_stats, admit=False)

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
            raise EngineDeadError(f"engine failed: {one_line(engine.dead_error)}")
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
            owner=caller_id(),  # VllmEngine Abort by this label reaches it from this key only
        )

    def _ready_engine(self) -> Any:
        return ready_engine(self._engine)


def _request_id(request: pb.GenerateRequest) -> str | None:
    if isinstance(request, pb.GenerateRequest) and request.HasField("request_id"):
        return request.request_id[:128]
    return None
