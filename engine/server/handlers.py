"""Building grpc method handlers that stand in for another one (interceptors)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc


def same_shape_handler(
    handler: grpc.RpcMethodHandler,
    behaviour: Callable,
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind (unary or streaming request and response) and
    serializers that runs ``behaviour``, optionally with another request deserializer.
    ``behaviour`` must be an async generator function where responses stream."""
    kwargs = {
        "request_deserializer": request_deserializer or handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behaviour, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behaviour, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behaviour, **kwargs)
    return grpc.unary_unary_rpc_method_handler(behaviour, **kwargs)
