"""With API keys, a label is scoped by the caller's key: VllmEngine Abort reaches only
the requests submitted with the same key, on either service. (Any caller used to end
any other caller's requests by naming their label.)"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from engine.client import SpecserveClient
from engine.server.app import ServerOptions
from tests.server.helpers import InProcessServer, wait_no_blocks_in_use, wait_until

KEY_A = "key-of-caller-a"
KEY_B = "key-of-caller-b"
PROMPT = [5, 6, 7, 8]
# 490 tokens: long enough that an Abort sent after the first chunk lands mid-stream.
LONG = dict(temperature=0.0, max_tokens=490, ignore_eos=True)


@pytest.fixture(scope="module")
def srv(engine_config):
    options = ServerOptions(host="127.0.0.1", port=0, api_key=(KEY_A, KEY_B))
    with InProcessServer(engine_config, options) as server:
        yield server


class Caller:
    """One API key's view of the server: VllmEngine Generate streams and Abort."""

    def __init__(self, channel: grpc.Channel, key: str) -> None:
        self.stub = vpb_grpc.VllmEngineStub(channel)
        self.metadata = (("authorization", f"Bearer {key}"),)

    def stream(self, label: str, **sampling) -> Iterator[vpb.GenerateResponse]:
        request = vpb.GenerateRequest(
            request_id=label, sampling_params=vpb.SamplingParams(**sampling), stream=True
        )
        request.tokenized.input_ids.extend(PROMPT)
        return self.stub.Generate(request, metadata=self.metadata, timeout=120)

    def abort(self, label: str) -> None:
        self.stub.Abort(vpb.AbortRequest(request_ids=[label]), metadata=self.metadata, timeout=10)


@pytest.fixture()
def callers(srv: InProcessServer):
    with grpc.insecure_channel(srv.target) as channel:
        yield Caller(channel, KEY_A), Caller(channel, KEY_B)


def _finish(responses: Iterator[vpb.GenerateResponse]) -> tuple[str, int]:
    """The rest of a stream: (finish_reason, completion tokens in its chunks)."""
    rest = list(responses)
    (complete,) = [r.complete for r in rest if r.WhichOneof("response") == "complete"]
    return complete.finish_reason, sum(len(r.chunk.token_ids) for r in rest if r.HasField("chunk"))


def _assert_nothing_held(srv: InProcessServer) -> None:
    with SpecserveClient(srv.target, api_key=KEY_A) as client:
        wait_no_blocks_in_use(client)
    wait_until(lambda: srv.engine.num_in_flight == 0, 10, "every request to leave the engine")
    assert not {"INTERNAL", "UNKNOWN"} & set(srv.errors)


def _first_chunk(responses: Iterator[vpb.GenerateResponse]) -> None:
    assert next(responses).WhichOneof("response") == "chunk"


def test_another_callers_abort_leaves_a_stream_running_to_completion(srv, callers):
    a, b = callers
    responses = a.stream("x", **LONG)
    _first_chunk(responses)
    b.abort("x")
    assert _finish(responses)[0] == "length"
    responses = a.stream("x", **LONG)
    _first_chunk(responses)
    a.abort("x")
    assert _finish(responses)[0] == "abort"
    _assert_nothing_held(srv)


def test_the_same_label_from_two_callers_is_two_labels(srv, callers):
    a, b = callers
    from_a, from_b = a.stream("x", **LONG), b.stream("x", **LONG)
    _first_chunk(from_a)
    _first_chunk(from_b)
    a.abort("x")
    assert _finish(from_a)[0] == "abort"
    assert _finish(from_b)[0] == "length"
    _assert_nothing_held(srv)


def test_generation_streams_are_scoped_by_key_too(srv, callers):
    """specserve.v1 Generate's request_id is the same label: only its owner's VllmEngine
    Abort ends the stream (specserve.v1 itself cancels by stream, never by label)."""
    a, b = callers
    with SpecserveClient(srv.target, api_key=KEY_A) as client:
        for aborter, reason in ((b, "length"), (a, "abort")):
            stream = iter(client.generate(PROMPT, request_id="x", **LONG))
            next(stream)
            aborter.abort("x")
            assert list(stream)[-1].finish_reason == reason
    _assert_nothing_held(srv)


def test_a_key_not_configured_is_refused(srv, callers):
    a, _ = callers
    responses = a.stream("x", **LONG)
    _first_chunk(responses)
    with grpc.insecure_channel(srv.target) as channel, pytest.raises(grpc.RpcError) as info:
        Caller(channel, KEY_A + "x").abort("x")
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _finish(responses)[0] == "length"
    _assert_nothing_held(srv)


def test_without_keys_any_caller_aborts_a_label(server):
    """No keys configured: behaviour unchanged, an Abort reaches every request so labelled."""
    with grpc.insecure_channel(server.target) as channel:
        caller = Caller(channel, "")
        caller.metadata = ()
        responses = caller.stream("x", **LONG)
        _first_chunk(responses)
        vpb_grpc.VllmEngineStub(channel).Abort(vpb.AbortRequest(request_ids=["x"]), timeout=10)
        assert _finish(responses)[0] == "abort"
