"""Random and extreme vllm.grpc.engine GenerateRequests: never UNKNOWN or INTERNAL, every
refusal one line; the server keeps serving and no request keeps KV blocks."""

from __future__ import annotations

import os

import grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from tests.server.helpers import InProcessServer, assert_still_serving

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
U32 = 2**32 - 1
I32 = (-(2**31), 2**31 - 1)

floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
valid_inputs = st.one_of(
    st.text(min_size=1, max_size=24).map(lambda t: {"text": t}),
    st.lists(st.integers(0, 200), min_size=1, max_size=12).map(
        lambda ids: {"tokenized": vpb.TokenizedInput(input_ids=ids)}
    ),
)
extreme_inputs = st.one_of(
    st.just({}),
    st.just({"text": ""}),
    st.lists(st.integers(0, U32), max_size=12).map(
        lambda ids: {"tokenized": vpb.TokenizedInput(input_ids=ids)}
    ),
    st.integers(500, 700).map(lambda n: {"tokenized": vpb.TokenizedInput(input_ids=[5] * n)}),
)
# field -> (mostly valid values, extreme or invalid values)
SAMPLING_FIELDS = {
    "max_tokens": (st.integers(1, 4), st.sampled_from([0, 513, 10**6, U32])),
    "temperature": (st.floats(0, 2, width=32), floats32),
    "top_k": (st.integers(0, 400), st.integers(0, U32)),
    "top_p": (st.floats(0.0625, 1, width=32), floats32),
    "min_p": (st.floats(0, 1, width=32), floats32),
    "frequency_penalty": (st.floats(-2, 2, width=32), floats32),
    "presence_penalty": (st.floats(-2, 2, width=32), floats32),
    "repetition_penalty": (st.floats(0.5, 2, width=32), floats32),
    "min_tokens": (st.integers(0, 2), st.integers(0, U32)),
    "n": (st.integers(0, 3), st.integers(0, U32)),
    "logprobs": (st.integers(0, 20), st.integers(*I32)),
    "seed": (st.integers(*I32), st.integers(*I32)),
    "truncate_prompt_tokens": (st.integers(1, 8), st.integers(*I32)),
}


@st.composite
def generate_requests(draw) -> vpb.GenerateRequest:
    """Each field is valid or absent most of the time and extreme about 1 time in 8."""

    def pick(valid, extreme):
        return draw(extreme if draw(st.integers(0, 7)) == 0 else valid)

    request = vpb.GenerateRequest(**pick(valid_inputs, extreme_inputs))
    request.request_id = pick(st.just(""), st.text(max_size=140))
    request.stream = draw(st.booleans())
    s = request.sampling_params
    for name, (valid, extreme) in SAMPLING_FIELDS.items():
        value = pick(st.none() | valid, extreme)
        if value is not None:
            setattr(s, name, value)
    if s.max_tokens == 0 and not s.HasField("max_tokens"):
        s.max_tokens = 4  # unset runs to the end of the context: keep examples quick
    s.stop.extend(pick(st.lists(st.text(min_size=1, max_size=5), max_size=3),
                       st.lists(st.text(max_size=300), max_size=20)))  # fmt: skip
    s.stop_token_ids.extend(pick(st.lists(st.integers(0, 200), max_size=3),
                                 st.lists(st.integers(0, U32), max_size=70)))  # fmt: skip
    bias = pick(st.dictionaries(st.integers(0, 200), st.floats(-5, 5, width=32), max_size=3),
                st.dictionaries(st.integers(*I32), floats32, max_size=5))  # fmt: skip
    s.logit_bias.update(bias)
    s.ignore_eos = draw(st.booleans())
    s.include_stop_str_in_output = draw(st.booleans())
    s.skip_special_tokens = draw(st.booleans())
    if draw(st.integers(0, 15)) == 0:
        s.regex = "a+"
    if draw(st.integers(0, 15)) == 0:
        request.data_parallel_rank = draw(st.integers(*I32))
    return request


@settings(
    max_examples=int(os.environ.get("SPECSERVE_PROPERTY_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=generate_requests())
def test_random_requests_never_unknown_or_internal(server: InProcessServer, request):
    with grpc.insecure_channel(server.target) as channel:
        stub = vpb_grpc.VllmEngineStub(channel)
        try:
            responses = list(stub.Generate(request, timeout=60))
            completes = [r for r in responses if r.WhichOneof("response") == "complete"]
            assert len(completes) == max(1, request.sampling_params.n)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
            assert "\n" not in (exc.details() or "")
        event(code.name)
        assert code in ALLOWED, f"{code.name}: {request}"


def test_server_still_serves_after_the_storm(server: InProcessServer):
    assert_still_serving(server)
