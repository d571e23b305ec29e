"""Every method's request bodies are handled by size before protobuf sees them
(engine/server/body_policy.py): large bodies of methods that never take one are refused
unparsed, unimplemented methods never parse a body, and the methods that carry prompts
decode large bodies in a worker thread."""

from __future__ import annotations

import threading

import grpc
import pytest
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import MethodDescriptor
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine.rpc import generation_pb2 as pb
from engine.server import body_policy, wire_pieces
from engine.server.body_policy import LARGE_BODY_METHODS, UNPARSED_METHODS, BodyPolicy

GARBAGE = b"\xff" * body_policy.LARGE_BODY_BYTES  # protobuf refuses it: 0xff is no tag


@pytest.fixture(scope="module")
def methods(server) -> list[MethodDescriptor]:
    """Every method of every service the server lists through reflection."""
    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (response,) = stub.ServerReflectionInfo(iter([request]), timeout=30)
    pool = descriptor_pool.Default()
    names = [s.name for s in response.list_services_response.service]
    return [m for name in names for m in pool.FindServiceByName(name).methods]


def _path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def _code(target: str, method: MethodDescriptor, body: bytes) -> tuple[grpc.StatusCode, str]:
    """Send ``body`` as it is: the status and details (the first response of a stream is
    enough: OK)."""
    with grpc.insecure_channel(target) as channel:
        path = _path(method)
        try:
            if method.client_streaming:
                call = channel.stream_stream(path)(iter([body]), timeout=30)
            elif method.server_streaming:
                call = channel.unary_stream(path)(body, timeout=30)
            else:
                channel.unary_unary(path)(body, timeout=30)
                return grpc.StatusCode.OK, ""
            next(call, None)
            call.cancel()
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def test_the_policy_names_real_methods_and_every_unimplemented_one(server, methods):
    paths = {_path(m) for m in methods}
    assert paths >= UNPARSED_METHODS | LARGE_BODY_METHODS
    unimplemented = {
        _path(m) for m in methods
        if _code(server.target, m, b"")[0] == grpc.StatusCode.UNIMPLEMENTED
    }  # fmt: skip
    assert unimplemented == UNPARSED_METHODS


def test_large_bodies_of_small_methods_are_refused_unparsed(server, methods):
    """Health, reflection (a request stream), model info, abort, ...: a body of 1 MiB or
    more is refused by its size; parsed, this one would be "not a valid" message."""
    small = [m for m in methods if body_policy.body_policy(_path(m)) is BodyPolicy.SMALL]
    assert len(small) >= 10
    for method in small:
        code, details = _code(server.target, method, GARBAGE)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, _path(method)
        assert details == (
            f"request body must be under 1048576 bytes for {_path(method)}, got {len(GARBAGE)}"
        )
        code, details = _code(server.target, method, GARBAGE[:-1])  # parsed on the spot
        assert details.startswith("request body is not a valid "), (_path(method), details)


def test_unimplemented_methods_never_parse_a_body(server, methods):
    for method in methods:
        if _path(method) in UNPARSED_METHODS:
            for body in (GARBAGE, GARBAGE[:10]):
                code, details = _code(server.target, method, body)
                assert code == grpc.StatusCode.UNIMPLEMENTED
                assert "is not supported" in details


def test_large_bodies_of_prompt_methods_are_decoded_off_the_event_loop(
    server, methods, monkeypatch
):
    decoded_on: list[str] = []
    parse_in_pieces = wire_pieces.parse_in_pieces

    def spy(data, message_class):
        decoded_on.append(threading.current_thread().name)
        return parse_in_pieces(data, message_class)

    monkeypatch.setattr(wire_pieces, "parse_in_pieces", spy)
    large = [m for m in methods if _path(m) in LARGE_BODY_METHODS]
    assert len(large) == len(LARGE_BODY_METHODS)
    for method in large:
        code, details = _code(server.target, method, GARBAGE)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        name = method.input_type.full_name
        assert details == f"request body is not a valid {name}: wire format was corrupt"
    # A well-formed one reaches validation (the tiny model's context is short).
    tokenize = next(m for m in large if m.name == "Tokenize")
    body = pb.TokenizeRequest(text="x" * body_policy.LARGE_BODY_BYTES).SerializeToString()
    code, details = _code(server.target, tokenize, body)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("text must have at most ")
    assert len(decoded_on) == len(large) + 1
    assert threading.current_thread().name not in decoded_on
    assert set(decoded_on) == {"large-body-decoder_0"}  # not the event loop's thread
