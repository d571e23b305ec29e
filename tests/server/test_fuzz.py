"""Raw bytes at every RPC the server exposes: a body that does not decode ends with
INVALID_ARGUMENT (UNAUTHENTICATED first when the API key is missing; UNIMPLEMENTED at a
method the server does not implement, which never parses its body), is counted and
logged at most at WARNING, and nothing ends UNKNOWN or INTERNAL."""

from __future__ import annotations

import logging
import random
from collections import Counter
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine.client import SpecserveClient
from engine.observability.metrics import EngineMetrics
from engine.observability.request_log import REQUEST_LOGGER_NAME, RateLimit, RequestLogger
from engine.rpc import generation_pb2 as pb  # also puts specserve.v1 in the default pool
from engine.server.app import ServerOptions
from engine.server.auth import EXEMPT_PREFIXES
from engine.server.body_policy import UNPARSED_METHODS
from tests.ops.scrape import parse, value
from tests.server.helpers import InProcessServer, wait_no_blocks_in_use

KEY = "fuzz-key"
SEED = 12
MARKER = b"MARKER"
BAD_UTF8 = b"\xffMARK\xfe"  # as long as MARKER: lengths in the message stay right
TIMEOUT_S = 30
NEVER = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
EXPECTED_METHODS = {
    "/specserve.v1.Generation/Generate",
    "/specserve.v1.Generation/GenerateComplete",
    "/specserve.v1.Generation/Tokenize",
    "/specserve.v1.Generation/GetModelInfo",
    "/specserve.v1.Generation/GetServerStats",
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.health.v1.Health/List",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
}


@dataclass
class Served:
    srv: InProcessServer
    metrics: EngineMetrics


@pytest.fixture(scope="module")
def served(engine_config):
    """A server with an API key, wired to metrics and request logs as `serve` wires them;
    the request log keeps at most 3 failure lines per code for the whole module."""
    srv = InProcessServer(engine_config, ServerOptions(host="127.0.0.1", port=0, api_key=KEY))
    metrics = EngineMetrics()
    request_logger = RequestLogger(rpc_log_limit=RateLimit(max_lines=3, window_s=3600))
    srv.server.on_rpc_error = metrics.on_rpc_error
    srv.server.on_rpc_failure = request_logger.on_rpc_error
    with srv:
        yield Served(srv, metrics)


def _exposed_methods(target: str) -> list[MethodDescriptor]:
    """Every method of every service the server lists through reflection."""
    with grpc.insecure_channel(target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (response,) = stub.ServerReflectionInfo(iter([request]), timeout=TIMEOUT_S)
    pool = descriptor_pool.Default()
    names = [s.name for s in response.list_services_response.service]
    return [m for name in names for m in pool.FindServiceByName(name).methods]


def _path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def _sample(descriptor: Descriptor, depth: int = 0):
    """A message with every string field (nested two deep) set to MARKER."""
    message = message_factory.GetMessageClass(descriptor)()
    for field in descriptor.fields:
        repeated = field.is_repeated
        if field.type == FieldDescriptor.TYPE_STRING:
            if repeated:
                getattr(message, field.name).append(MARKER.decode())
            else:
                setattr(message, field.name, MARKER.decode())
        elif field.type == FieldDescriptor.TYPE_MESSAGE and depth < 2:
            if field.message_type.GetOptions().map_entry:
                continue
            sub = _sample(field.message_type, depth + 1)
            if repeated:
                getattr(message, field.name).add().CopyFrom(sub)
            else:
                getattr(message, field.name).CopyFrom(sub)
    return message


def _bodies(descriptor: Descriptor, rng: random.Random) -> list[bytes]:
    """Empty, a valid sample, the sample with invalid UTF-8 in its strings (all, and
    each one alone), truncations of it, and random bytes."""
    valid = _sample(descriptor).SerializeToString()
    bodies = [b"", valid]
    if MARKER in valid:
        bodies.append(valid.replace(MARKER, BAD_UTF8))
        parts = valid.split(MARKER)
        for i in range(1, len(parts)):  # the i-th marker alone
            bodies.append(MARKER.join(parts[:i]) + BAD_UTF8 + MARKER.join(parts[i:]))
    if len(valid) > 1:
        bodies += [valid[: rng.randrange(1, len(valid))] for _ in range(4)]
    bodies += [rng.randbytes(rng.randrange(1, 48)) for _ in range(12)]
    return bodies


def _decodes(descriptor: Descriptor, body: bytes) -> bool:
    try:
        message_factory.GetMessageClass(descriptor).FromString(body)
    except Exception:
        return False
    return True


def _call(
    channel: grpc.Channel, method: MethodDescriptor, body: bytes, metadata
) -> grpc.RpcError | None:
    """Send ``body`` as is; None when the call went through (the first response of a
    stream is enough: a stream is cancelled after it), else the error."""
    kwargs = dict(timeout=TIMEOUT_S, metadata=metadata)
    path = _path(method)
    try:
        if method.client_streaming:
            list(channel.stream_stream(path)(iter([body]), **kwargs))
        elif method.server_streaming:
            call = channel.unary_stream(path)(body, **kwargs)
            next(call, None)
            call.cancel()
        else:
            channel.unary_unary(path)(body, **kwargs)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:  # the cancel above, not the server
            return exc
    return None


def _fuzz(target: str, api_key: str | None, rng: random.Random) -> Counter:
    """Every body at every method; checks each answer, returns the codes seen."""
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    seen: Counter = Counter()
    methods = _exposed_methods(target)
    assert {_path(m) for m in methods} >= EXPECTED_METHODS
    with grpc.insecure_channel(target) as channel:
        for method in methods:
            needs_key = not _path(method).startswith(EXEMPT_PREFIXES)
            for body in _bodies(method.input_type, rng):
                error = _call(channel, method, body, metadata)
                code = grpc.StatusCode.OK if error is None else error.code()
                seen[code.name] += 1
                where = f"{_path(method)} body={body!r}"
                assert code not in NEVER, f"{where}: {code.name} {error.details()}"
                if needs_key and api_key != KEY:
                    assert code == grpc.StatusCode.UNAUTHENTICATED, where
                elif _path(method) in UNPARSED_METHODS:  # its body is never parsed
                    assert code == grpc.StatusCode.UNIMPLEMENTED, where
                elif not _decodes(method.input_type, body):
                    assert code == grpc.StatusCode.INVALID_ARGUMENT, where
                    prefix = f"request body is not a valid {method.input_type.full_name}: "
                    assert error.details().startswith(prefix), error.details()
                    assert "\n" not in error.details()
    return seen


def test_raw_bytes_at_every_rpc(served: Served, caplog) -> None:
    caplog.set_level(logging.INFO)
    rng = random.Random(SEED)
    seen = Counter()
    for api_key in (KEY, None, KEY + "x"):
        seen += _fuzz(served.srv.target, api_key, rng)
    assert seen["INVALID_ARGUMENT"] >= 200 and seen["UNAUTHENTICATED"] >= 100
    # Every refusal the callers saw was counted once, under its code.
    samples = parse(served.metrics.render())
    for code in ("INVALID_ARGUMENT", "UNAUTHENTICATED"):
        assert value(samples, "specserve_grpc_errors_total", code=code) == seen[code]
    assert ("specserve_grpc_errors_total", frozenset({("code", "UNKNOWN")})) not in samples
    # No ERROR (grpc's traceback per bad body, before); failure lines are rate-limited.
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    failure_lines = Counter(
        r.fields["code"] for r in caplog.records if r.name == REQUEST_LOGGER_NAME
        and r.getMessage().startswith("rpc failed")
    )  # fmt: skip
    assert failure_lines["INVALID_ARGUMENT"] == 3 and failure_lines["UNAUTHENTICATED"] == 3
    # The server kept serving, and no request holds KV blocks.
    with SpecserveClient(served.srv.target, api_key=KEY) as client:
        assert client.health() == "SERVING"
        assert len(client.generate_complete("Hi", max_tokens=2).token_ids) == 2
        wait_no_blocks_in_use(client)


def test_a_bad_message_inside_a_request_stream(served: Served) -> None:
    """Reflection decodes each message as the handler iterates the stream: the answers
    to the good messages before it arrive, then the call ends INVALID_ARGUMENT."""
    good = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    bad = b"\x0a\x05ab"  # field 1, length 5, but only 2 bytes follow
    path = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    responses = []
    with grpc.insecure_channel(served.srv.target) as channel:
        call = channel.stream_stream(path)(iter([good, good, bad, good]), timeout=TIMEOUT_S)
        with pytest.raises(grpc.RpcError) as info:
            for response in call:
                responses.append(response)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ServerReflectionRequest" in info.value.details()
    assert len(responses) == 2


def test_the_reason_is_one_short_line(served: Served) -> None:
    body = pb.TokenizeRequest(text=MARKER.decode()).SerializeToString().replace(MARKER, BAD_UTF8)
    metadata = (("authorization", f"Bearer {KEY}"),)
    with grpc.insecure_channel(served.srv.target) as channel:
        tokenize = channel.unary_unary("/specserve.v1.Generation/Tokenize")
        with pytest.raises(grpc.RpcError) as info:
            tokenize(body, timeout=TIMEOUT_S, metadata=metadata)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == (
        "request body is not a valid specserve.v1.TokenizeRequest: string field had bad UTF-8"
    )
