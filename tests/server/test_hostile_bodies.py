"""Large request bodies of any shape, at any method, stall no health check: six bodies of
about 14 MiB at once, from another process, to a method the server answers UNIMPLEMENTED
(Embed), to a method that never takes a large body (Abort), as Generate requests whose
prompt ids follow a text field, and with millions of stop strings."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from google.protobuf.message import Message
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from engine.client import SpecserveClient
from engine.rpc import generation_pb2 as pb
from tests.server.flood import (
    CONTROL_METHOD,
    HealthProbe,
    flood_answers,
    frozen_heap,
    health_bound,
    raw_flood,
    run_flood,
    whole_parse_s,
)

NUM_BODIES = 6
NUM_IDS = 15_000_000  # about 14 MiB packed, under the 16 MiB message cap
KEPT = 16  # truncate_prompt_tokens: the ids a Generate keeps
MiB = 1 << 20


@dataclass(frozen=True)
class _Case:
    method: str
    request_type: type[Message]
    build: Callable[[], bytes]
    check: Callable[[str, bytes | str], bool]  # (code name, reply or details) -> as expected?


def _embed() -> bytes:
    request = vpb.EmbedRequest(request_id="huge")
    request.tokenized.input_ids.extend(itertools.repeat(5, NUM_IDS))
    return request.SerializeToString()


def _abort() -> bytes:
    ids = (f"request-{i:07d}" for i in range(14 * MiB // 18))
    return vpb.AbortRequest(request_ids=ids).SerializeToString()


# Serialized messages concatenate as a merge: the later member of the prompt oneof (the
# ids) replaces the text.
def _specserve_text_then_ids() -> bytes:
    sampling = pb.SamplingOptions(max_tokens=1, truncate_prompt_tokens=KEPT)
    request = pb.GenerateRequest(sampling=sampling)
    request.token_ids.ids.extend(itertools.repeat(5, NUM_IDS))
    return pb.GenerateRequest(text="x").SerializeToString() + request.SerializeToString()


def _vllm_text_then_ids() -> bytes:
    sampling = vpb.SamplingParams(max_tokens=1, truncate_prompt_tokens=KEPT)
    request = vpb.GenerateRequest(request_id="huge", sampling_params=sampling)
    request.tokenized.input_ids.extend(itertools.repeat(5, NUM_IDS))
    return vpb.GenerateRequest(text="x").SerializeToString() + request.SerializeToString()


def _stop_strings() -> bytes:
    sampling = pb.SamplingOptions(max_tokens=1, stop=itertools.repeat("x", 14 * MiB // 3))
    return pb.GenerateRequest(text="hi", sampling=sampling).SerializeToString()


def _specserve_prompt_tokens(code: str, reply: bytes | str) -> int | None:
    """The prompt tokens a stream's last response counts."""
    return pb.GenerateResponse.FromString(reply).usage.prompt_tokens if code == "OK" else None


def _vllm_prompt_tokens(code: str, reply: bytes | str) -> int | None:
    return vpb.GenerateResponse.FromString(reply).complete.prompt_tokens if code == "OK" else None


CASES = {
    "Embed (unimplemented)": _Case(
        "/vllm.grpc.engine.VllmEngine/Embed",
        vpb.EmbedRequest,
        _embed,
        lambda code, details: code == "UNIMPLEMENTED" and "Embed is not supported" in details,
    ),
    "Abort (never large)": _Case(
        "/vllm.grpc.engine.VllmEngine/Abort",
        vpb.AbortRequest,
        _abort,
        lambda code, details: (
            code == "INVALID_ARGUMENT"
            and details.startswith(
                "request body must be under 1048576 bytes for /vllm.grpc.engine.VllmEngine/Abort"
            )
        ),
    ),
    "specserve Generate, text before ids": _Case(
        "/specserve.v1.Generation/Generate",
        pb.GenerateRequest,
        _specserve_text_then_ids,
        lambda code, reply: _specserve_prompt_tokens(code, reply) == KEPT,
    ),
    "VllmEngine Generate, text before ids": _Case(
        "/vllm.grpc.engine.VllmEngine/Generate",
        vpb.GenerateRequest,
        _vllm_text_then_ids,
        lambda code, reply: _vllm_prompt_tokens(code, reply) == KEPT,
    ),
    "GenerateComplete, millions of stop strings": _Case(
        "/specserve.v1.Generation/GenerateComplete",
        pb.GenerateRequest,
        _stop_strings,
        lambda code, details: (
            code == "INVALID_ARGUMENT"
            and details.startswith(
                "request body must have at most 8192 fields outside packed lists"
            )
        ),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_six_huge_bodies_at_once_stall_no_health_check(server, name, tmp_path):
    case = CASES[name]
    data = case.build()
    assert 13 * MiB < len(data) < 16 * MiB
    parse_s = whole_parse_s(case.request_type.FromString, data)
    control_data = b"\xff" * len(data)
    with (
        SpecserveClient(server.target) as client,
        raw_flood(server.target, CONTROL_METHOD, control_data, NUM_BODIES, tmp_path / "control")
        as control,
        raw_flood(server.target, case.method, data, NUM_BODIES, tmp_path) as sender,
        frozen_heap(),
    ):  # fmt: skip
        probe = HealthProbe(client)
        probe.start()
        baseline = probe.baseline()
        control_flood = run_flood(probe, control)
        flood = run_flood(probe, sender)
        probe.finish()
    answers = flood_answers(tmp_path, NUM_BODIES)
    assert all(case.check(code, answer) for code, answer in answers), answers[0]
    bound = health_bound(baseline, parse_s, control_flood.health_s)
    print(f"{name}: health {baseline * 1000:.0f} ms, {control_flood.health_s * 1000:.0f} ms "
          f"in the control flood -> {flood.health_s * 1000:.0f} ms (bound {bound * 1000:.0f} "
          f"ms, a whole parse {parse_s * 1000:.0f} ms); flood {flood.flood_s:.2f} s, "
          f"{flood.num_answers} health answers")  # fmt: skip
    assert flood.num_answers >= 1  # health answered while the bodies were being handled
    assert flood.health_s < bound
