"""Random and extreme GenerateRequests: never UNKNOWN or INTERNAL; the server keeps serving."""

from __future__ import annotations

import os

import grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.rpc import generation_pb2 as pb
from engine.rpc import generation_pb2_grpc as pb_grpc
from tests.server.helpers import InProcessServer, assert_still_serving

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
U32 = 2**32 - 1
U64 = 2**64 - 1

floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
words = st.text(max_size=24)
# Token ids below 200 exist in every tiny test model (their vocabularies have >= 256).
valid_ids = st.lists(st.integers(0, 200), min_size=1, max_size=12)
valid_roles = st.sampled_from(["system", "user", "assistant"])
any_roles = st.sampled_from(["system", "user", "assistant", "tool", "", "robot", "USER"])


def _chat(roles) -> st.SearchStrategy[list[pb.ChatMessage]]:
    return st.lists(st.builds(pb.ChatMessage, role=roles, content=words), max_size=4)


valid_prompts = st.one_of(
    st.text(min_size=1, max_size=24).map(lambda t: {"text": t}),
    valid_ids.map(lambda ids: {"token_ids": pb.TokenIds(ids=ids)}),
    _chat(valid_roles).filter(bool).map(lambda m: {"chat": pb.ChatMessages(messages=m)}),
)
extreme_prompts = st.one_of(
    st.just({}),
    st.just({"text": ""}),
    st.lists(st.integers(0, 2**32 - 1), max_size=12).map(
        lambda ids: {"token_ids": pb.TokenIds(ids=ids)}
    ),
    st.integers(500, 700).map(lambda n: {"token_ids": pb.TokenIds(ids=[5] * n)}),
    _chat(any_roles).map(lambda m: {"chat": pb.ChatMessages(messages=m)}),
)
valid_speculation = st.one_of(
    st.just(pb.SpeculationOptions(mode=pb.SpeculationOptions.MODE_OFF)),
    st.integers(1, 8).map(
        lambda k: pb.SpeculationOptions(
            mode=pb.SpeculationOptions.MODE_FIXED, num_speculative_tokens=k
        )
    ),
)
extreme_speculation = st.builds(
    pb.SpeculationOptions,
    mode=st.sampled_from([0, 1, 2, 9]),
    num_speculative_tokens=st.sampled_from([0, 1, 64, 65, U32]),
)
# field -> (mostly valid values, extreme or invalid values)
SAMPLING_FIELDS = {
    "max_tokens": (st.integers(1, 4), st.sampled_from([0, 513, 10**6, U32])),
    "temperature": (st.floats(0, 2, width=32), floats32),
    "top_k": (st.integers(0, 400), st.integers(0, U32)),
    "top_p": (st.floats(0.0625, 1, width=32), floats32),
    "min_p": (st.floats(0, 1, width=32), floats32),
    "seed": (st.integers(0, 2**63 - 1), st.integers(0, U64)),
    "top_logprobs": (st.integers(0, 20), st.integers(0, U32)),
}


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    """Each field is valid or absent most of the time and extreme about 1 time in 8."""

    def pick(valid, extreme):
        return draw(extreme if draw(st.integers(0, 7)) == 0 else valid)

    request = pb.GenerateRequest(**pick(valid_prompts, extreme_prompts))
    request_id = pick(st.none(), st.text(max_size=140))
    if request_id is not None:
        request.request_id = request_id
    s = request.sampling
    for name, (valid, extreme) in SAMPLING_FIELDS.items():
        value = pick(st.none() | valid, extreme)
        if value is not None:
            setattr(s, name, value)
    s.stop.extend(pick(st.lists(st.text(min_size=1, max_size=5), max_size=3),
                       st.lists(st.text(max_size=300), max_size=20)))  # fmt: skip
    s.stop_token_ids.extend(pick(st.lists(st.integers(0, 200), max_size=3),
                                 st.lists(st.integers(0, U32), max_size=70)))  # fmt: skip
    s.ignore_eos = draw(st.booleans())
    speculation = pick(st.none() | valid_speculation, extreme_speculation)
    if speculation is not None:
        request.speculation.CopyFrom(speculation)
    request.priority = pick(st.integers(-5, 5), st.integers(-(2**31), 2**31 - 1))
    return request


@settings(
    max_examples=int(os.environ.get("SPECSERVE_PROPERTY_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=generate_requests(), streaming=st.booleans())
def test_random_requests_never_unknown_or_internal(server: InProcessServer, request, streaming):
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        try:
            if streaming:
                responses = list(stub.Generate(request, timeout=60))
                assert responses and responses[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
            else:
                stub.GenerateComplete(request, timeout=60)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
            assert "\n" not in (exc.details() or "")
        event(code.name)
        assert code in ALLOWED, f"{code.name}: {request}"


def test_server_still_serves_after_the_storm(server: InProcessServer):
    assert_still_serving(server)
