"""Undecodable request bodies end with INVALID_ARGUMENT, on every RPC the server exposes.

grpc.aio calls a handler's ``request_deserializer`` itself: for unary requests before the
handler runs, for request streams inside the request iterator. When it raises (truncated
or random bytes, invalid UTF-8 in a proto3 string field) grpc logs an ERROR with a
traceback and answers UNKNOWN, and no hook of ours sees it. ``DecodeGuardInterceptor``
wraps every handler instead: the deserializer returns an ``Undecodable`` marker rather
than raising, and the wrapped behaviour ends the call with INVALID_ARGUMENT, reported
through the server's error hook like any other failed RPC. It sits inside the API-key
interceptor, so a caller without a valid key hears UNAUTHENTICATED whatever its body.

Generate bodies of 1 MiB or more are decoded by the handler in a worker thread, with only
the prompt ids validation can keep (wire.py): protobuf parsing 15M ids held this event
loop, health checks included, 0.1-0.2 s each.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from engine.server import wire
from engine.server.handlers import same_shape_handler

ReportError = Callable[[grpc.StatusCode, str, str | None], None]
# The most prompt ids a request may keep (validation refuses more); None while unknown.
MaxPromptIds = Callable[[], int | None]


class Undecodable:
    """Stands in for a request whose bytes did not decode; ``details`` is one line."""

    __slots__ = ("details",)

    def __init__(self, details: str) -> None:
        self.details = details


class DecodeGuardInterceptor(grpc.aio.ServerInterceptor):
    """Turn request-decoding failures into INVALID_ARGUMENT for every async handler."""

    def __init__(
        self,
        report_error: ReportError = lambda code, details, request_id: None,
        max_prompt_ids: MaxPromptIds = lambda: None,
    ):
        self._report_error = report_error
        self._max_prompt_ids = max_prompt_ids

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return guard_handler(handler, self._refuse, self._max_prompt_ids)

    async def _refuse(self, request: Undecodable, context: grpc.aio.ServicerContext) -> None:
        self._report_error(grpc.StatusCode.INVALID_ARGUMENT, request.details, None)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)


Refuse = Callable[[Undecodable, Any], Any]


def guard_handler(
    handler: grpc.RpcMethodHandler, refuse: Refuse, max_prompt_ids: MaxPromptIds = lambda: None
) -> grpc.RpcMethodHandler:
    """``handler`` with a deserializer that never raises and a behaviour that refuses
    ``Undecodable`` requests. Sync behaviours (none registered here) are left as they are:
    they would run in grpc's thread pool, where ``refuse`` cannot be awaited."""
    behaviour = _behaviour(handler)
    if not (inspect.iscoroutinefunction(behaviour) or inspect.isasyncgenfunction(behaviour)):
        return handler
    deserialize = handler.request_deserializer
    if handler.request_streaming:
        guarded = _guard_request_stream(behaviour, refuse)
        safe = _safe_deserializer(deserialize, None)  # a stream's messages are never deferred
    else:
        guarded = _guard_unary_request(behaviour, refuse)
        safe = _safe_deserializer(deserialize, max_prompt_ids)
    return same_shape_handler(handler, guarded, safe)


def _behaviour(handler: grpc.RpcMethodHandler) -> Callable:
    if handler.request_streaming:
        return handler.stream_stream if handler.response_streaming else handler.stream_unary
    return handler.unary_stream if handler.response_streaming else handler.unary_unary


def _safe_deserializer(
    deserialize: Callable[[bytes], Any], max_prompt_ids: MaxPromptIds | None = lambda: None
) -> Callable[[bytes], Any]:
    """``deserialize`` returning ``Undecodable`` rather than raising. With
    ``max_prompt_ids`` (unary requests), a body of MIN_TRIM_BYTES or more of a request
    type with prompt ids comes back ``Deferred``: the handler decodes it off the event
    loop, as ``wire.Trimmed`` when it carries more than ``max_prompt_ids()``."""
    type_name = _message_type_name(deserialize)
    prompt = wire.PROMPT_FIELDS.get(type_name) if max_prompt_ids is not None else None

    def safe(data: bytes, trim: bool = False) -> Any:
        try:
            max_ids = max_prompt_ids() if trim else None
            if max_ids is not None:
                trimmed = wire.decode_trimmed(data, prompt, max_ids, deserialize)
                if trimmed is not None:
                    return trimmed
            return deserialize(data)
        except Exception as exc:
            return Undecodable(
                f"request body is not a valid {type_name}: {_short_reason(exc, type_name)}"
            )

    if prompt is None:
        return safe

    def deferred(data: bytes) -> Any:
        # grpc.aio deserializes on the event loop: a large body is decoded by the handler
        # in a worker thread instead (numpy's passes over it release the GIL).
        if len(data) < wire.MIN_TRIM_BYTES:
            return safe(data)
        return Deferred(data, functools.partial(safe, trim=True))

    return deferred


@dataclasses.dataclass(frozen=True, slots=True)
class Deferred:
    """A large request body the handler decodes off the event loop (``_decoded``)."""

    data: bytes
    decode: Callable[[bytes], Any]


async def _decoded(request: Any) -> Any:
    if isinstance(request, Deferred):
        return await asyncio.to_thread(request.decode, request.data)
    return request


def _message_type_name(deserialize: Callable) -> str:
    """'specserve.v1.GenerateRequest' for ``GenerateRequest.FromString``."""
    message_class = getattr(deserialize, "__self__", None)
    descriptor = getattr(message_class, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", None) or "request message"


def _short_reason(exc: Exception, type_name: str) -> str:
    # upb says "Error parsing message with type 'T': Wire format was corrupt"; keep the
    # part after the type, which is the reason ("String field had bad UTF-8", ...).
    text = " ".join(str(exc).split()) or type(exc).__name__
    prefix = f"Error parsing message with type '{type_name}': "
    if text.startswith(prefix):
        text = text[len(prefix) :]
    text = text[:200]
    return text[:1].lower() + text[1:]


def _guard_unary_request(behaviour: Callable, refuse: Refuse) -> Callable:
    # grpc.aio tells a coroutine handler from an async-generator one by inspection, so
    # the wrapper must be of the same kind as the behaviour it wraps.
    if inspect.isasyncgenfunction(behaviour):

        async def guarded_stream(request, context):
            request = await _decoded(request)
            if isinstance(request, Undecodable):
                await refuse(request, context)
                return
            async for response in behaviour(wire.unwrap(request), context):
                yield response

        return guarded_stream

    async def guarded(request, context):
        request = await _decoded(request)
        if isinstance(request, Undecodable):
            return await refuse(request, context)
        return await behaviour(wire.unwrap(request), context)

    return guarded


def _guard_request_stream(behaviour: Callable, refuse: Refuse) -> Callable:
    if inspect.isasyncgenfunction(behaviour):

        async def guarded_stream(requests, context):
            async for response in behaviour(_checked(requests, context, refuse), context):
                yield response

        return guarded_stream

    async def guarded(requests, context):
        return await behaviour(_checked(requests, context, refuse), context)

    return guarded


async def _checked(requests: AsyncIterator, context: Any, refuse: Refuse) -> AsyncIterator:
    """The request stream, ending the call at the first message that did not decode
    (``refuse`` aborts: its AbortError unwinds the handler iterating this stream)."""
    async for request in requests:
        if isinstance(request, Undecodable):
            await refuse(request, context)
        yield request
