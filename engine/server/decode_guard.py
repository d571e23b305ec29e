"""Undecodable request bodies end with INVALID_ARGUMENT, on every RPC the server exposes.

grpc.aio calls a handler's ``request_deserializer`` itself: for unary requests before the
handler runs, for request streams inside the request iterator. When it raises (truncated
or random bytes, invalid UTF-8 in a proto3 string field) grpc logs an ERROR with a
traceback and answers UNKNOWN, and no hook of ours sees it. ``DecodeGuardInterceptor``
wraps every handler instead: the deserializer returns an ``Undecodable`` marker rather
than raising, and the wrapped behaviour ends the call with INVALID_ARGUMENT, reported
through the server's error hook like any other failed RPC. It sits inside the API-key
interceptor, so a caller without a valid key hears UNAUTHENTICATED whatever its body.

It also decides, by size and before protobuf sees a byte, where each body is decoded
(body_policy.py): a method answered UNIMPLEMENTED never parses its body; a body of 1 MiB
or more is refused unparsed, or, for the methods that carry prompts, decoded by the
handler in a worker thread, a piece at a time (wire_pieces.py) and with only the prompt
ids validation can keep (wire.py). Protobuf parsing one 14 MiB body holds the GIL
55-85 ms: on the event loop, or whole in a worker thread, six of them at once kept
health checks waiting 0.3-0.8 s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from engine.server import body_policy, wire, wire_pieces
from engine.server.body_policy import BodyPolicy
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
        method = handler_call_details.method
        return guard_handler(handler, self._refuse, method, self._max_prompt_ids)

    async def _refuse(self, request: Undecodable, context: grpc.aio.ServicerContext) -> None:
        self._report_error(grpc.StatusCode.INVALID_ARGUMENT, request.details, None)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)


Refuse = Callable[[Undecodable, Any], Any]


def guard_handler(
    handler: grpc.RpcMethodHandler,
    refuse: Refuse,
    method: str,
    max_prompt_ids: MaxPromptIds = lambda: None,
) -> grpc.RpcMethodHandler:
    """``handler`` with a deserializer that never raises (``request_decoder``) and a
    behaviour that refuses ``Undecodable`` requests. Sync behaviours (none registered
    here) are left as they are: they would run in grpc's thread pool, where ``refuse``
    cannot be awaited."""
    behaviour = _behaviour(handler)
    if not (inspect.iscoroutinefunction(behaviour) or inspect.isasyncgenfunction(behaviour)):
        return handler
    streaming = handler.request_streaming
    decode = request_decoder(method, handler.request_deserializer, streaming, max_prompt_ids)
    if streaming:
        guarded = _guard_request_stream(behaviour, refuse)
    else:
        guarded = _guard_unary_request(behaviour, refuse)
    return same_shape_handler(handler, guarded, decode)


def _behaviour(handler: grpc.RpcMethodHandler) -> Callable:
    if handler.request_streaming:
        return handler.stream_stream if handler.response_streaming else handler.stream_unary
    return handler.unary_stream if handler.response_streaming else handler.unary_unary


def request_decoder(
    method: str,
    deserialize: Callable[[bytes], Any],
    streaming: bool = False,
    max_prompt_ids: MaxPromptIds = lambda: None,
) -> Callable[[bytes], Any]:
    """What grpc calls in place of ``deserialize`` on ``method``'s request bodies, on the
    event loop. It never raises (an ``Undecodable`` instead) and never parses a body of
    LARGE_BODY_BYTES or more: by ``body_policy``, it refuses it, or (a unary request)
    returns it ``Deferred`` for the handler to decode off the loop (``_decode_large``)."""
    policy = body_policy.body_policy(method)
    parse = _safe_deserializer(deserialize)
    if policy is BodyPolicy.UNPARSED:
        return lambda data: parse(b"")  # answered UNIMPLEMENTED: what it says is moot
    decode_large = None
    if policy is BodyPolicy.LARGE and not streaming:
        decode_large = functools.partial(_decode_large, deserialize, max_prompt_ids)

    def decode(data: bytes) -> Any:
        if len(data) < body_policy.LARGE_BODY_BYTES:
            return parse(data)
        if decode_large is None:
            return Undecodable(body_policy.too_large(method, len(data)))
        return Deferred(data, decode_large)

    return decode


def _safe_deserializer(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``deserialize`` returning ``Undecodable`` rather than raising."""
    type_name = _message_type_name(deserialize)

    def safe(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:
            return Undecodable(_not_valid(type_name, exc))

    return safe


def _decode_large(
    deserialize: Callable[[bytes], Any], max_prompt_ids: MaxPromptIds, data: bytes
) -> Any:
    """A large body decoded a piece at a time (in a worker thread: numpy's passes over it
    release the GIL, protobuf's are short); a ``wire.Trimmed`` when validation can keep
    only some of its prompt ids; an ``Undecodable`` when it does not decode."""
    message_class = getattr(deserialize, "__self__", None)
    if not (isinstance(message_class, type) and issubclass(message_class, Message)):
        return _safe_deserializer(deserialize)(data)
    type_name = message_class.DESCRIPTOR.full_name
    parse = functools.partial(wire_pieces.parse_in_pieces, message_class=message_class)
    try:
        prompt = wire.PROMPT_FIELDS.get(type_name)
        max_ids = max_prompt_ids() if prompt is not None else None
        if max_ids is not None:
            trimmed = wire.decode_trimmed(data, prompt, max_ids, parse)
            if trimmed is not None:
                return trimmed
        return parse(data)
    except wire_pieces.BodyRefused as exc:
        return Undecodable(str(exc))
    except Exception as exc:
        return Undecodable(_not_valid(type_name, exc))


@dataclasses.dataclass(frozen=True, slots=True)
class Deferred:
    """A large request body the handler decodes off the event loop (``_decoded``)."""

    data: bytes
    decode: Callable[[bytes], Any]


# One thread decodes every large body, one at a time: the Python steps of a decode hold
# the GIL in turns of 5 ms (sys.getswitchinterval), and with six threads taking turns the
# event loop waited for most of them (health 0.29 s while six bodies were walked).
_LARGE_BODY_DECODER = concurrent.futures.ThreadPoolExecutor(1, "large-body-decoder")


async def _decoded(request: Any) -> Any:
    if isinstance(request, Deferred):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_LARGE_BODY_DECODER, request.decode, request.data)
    return request


def _message_type_name(deserialize: Callable) -> str:
    """'specserve.v1.GenerateRequest' for ``GenerateRequest.FromString``."""
    message_class = getattr(deserialize, "__self__", None)
    descriptor = getattr(message_class, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", None) or "request message"


def _not_valid(type_name: str, exc: Exception) -> str:
    return f"request body is not a valid {type_name}: {_short_reason(exc, type_name)}"


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
