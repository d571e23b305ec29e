"""Decoding huge prompt-id requests with only their last ids (engine/server/wire.py): the
result is protobuf's own parse restricted to those ids, validation answers as it would
for the whole list, and every body the walk does not expect is left to protobuf."""

from __future__ import annotations

import asyncio
import contextvars
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from engine.rpc import generation_pb2 as pb
from engine.server import body_policy, decode_guard, wire
from engine.server.decode_guard import Undecodable
from engine.server.validation import InvalidArgument, ModelLimits, to_engine_request
from engine.server.vllm_request import to_vllm_request

U32 = 2**32 - 1
LIMITS = ModelLimits(vocab_size=100, max_model_len=8)
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class _Type:
    """One request type with prompt ids, and how a test reaches them."""

    message: type[Message]
    path: str  # "token_ids.ids"
    sibling: Callable[[], Message]  # a request with another member of the prompt oneof
    validate: Callable[[Message], object]

    @property
    def field(self) -> wire.PromptField:
        return wire.PROMPT_FIELDS[self.message.DESCRIPTOR.full_name]

    def ids(self, message: Message):
        outer, inner = self.path.split(".")
        return getattr(getattr(message, outer), inner)

    def parse(self, data: bytes) -> Message:
        return self.message.FromString(data)


TYPES = {
    "specserve.v1": _Type(
        pb.GenerateRequest,
        "token_ids.ids",
        lambda: pb.GenerateRequest(text="x"),
        lambda m: to_engine_request(m, LIMITS).prompt,
    ),
    "VllmEngine": _Type(
        vpb.GenerateRequest,
        "tokenized.input_ids",
        lambda: vpb.GenerateRequest(text="x"),
        lambda m: to_vllm_request(m, LIMITS, 8).prompt_ids,
    ),
}


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _packed(type_: _Type, ids: list[int]) -> bytes:
    """A prompt message holding ``ids`` as one packed field (values over 32 bits too:
    protobuf keeps their low 32 bits)."""
    return _field(type_.field.outer, _field(type_.field.inner, b"".join(map(_varint, ids))))


def _expected(type_: _Type, data: bytes, max_ids: int) -> tuple[Message, int]:
    """protobuf's parse of ``data`` with only the last ``max_ids`` ids, and the count."""
    message = type_.parse(data)
    ids = type_.ids(message)
    num_ids = len(ids)
    if num_ids > max_ids:  # (a prompt another member of the oneof holds stays unset)
        del ids[: num_ids - max_ids]
    return message, num_ids


def _check_exact(type_: _Type, data: bytes, max_ids: int) -> wire.Trimmed | None:
    """decode_trimmed on ``data``: None, or exactly protobuf's parse of the kept ids."""
    trimmed = wire.decode_trimmed(data, type_.field, max_ids, type_.parse)
    if trimmed is not None:
        message, num_ids = _expected(type_, data, max_ids)  # raises if protobuf refuses
        assert trimmed.message == message
        assert trimmed.message.SerializeToString() == message.SerializeToString()
        assert trimmed.num_ids == num_ids
    return trimmed


# ---- random requests --------------------------------------------------------------

id_lists = st.lists(st.one_of(st.integers(0, 300), st.integers(0, U32)), max_size=30)
# Raw varints up to 64 bits, as a sender may write them (protobuf keeps the low 32).
wide_id_lists = st.lists(st.one_of(st.integers(0, 300), st.integers(0, 2**64 - 1)), max_size=30)
unknown_fields = st.lists(
    st.tuples(st.integers(100, 200), st.binary(max_size=6)).map(lambda f: _field(*f)),
    max_size=3,
).map(b"".join)


def _other_fields(type_: _Type, draw) -> Message:
    """A request of ``type_`` with some of its other fields set."""
    if type_.message is pb.GenerateRequest:
        sampling = pb.SamplingOptions(
            max_tokens=draw(st.integers(1, 8)),
            stop=draw(st.lists(st.text(max_size=4), max_size=2)),
        )
        if draw(st.booleans()):
            sampling.truncate_prompt_tokens = draw(st.integers(1, 12))
        priority = draw(st.integers(-1000, 1000))
        return pb.GenerateRequest(
            request_id=draw(st.text(max_size=8)), sampling=sampling, priority=priority
        )
    sampling = vpb.SamplingParams(max_tokens=draw(st.integers(1, 8)))
    if draw(st.booleans()):
        sampling.truncate_prompt_tokens = draw(st.sampled_from([-1, 1, 3, 12]))
    request = vpb.GenerateRequest(
        request_id=draw(st.text(max_size=8)), sampling_params=sampling, stream=draw(st.booleans())
    )
    if draw(st.booleans()):
        request.tokenized.original_text = draw(st.text(max_size=8))
    return request


@st.composite
def bodies(draw, type_: _Type) -> bytes:
    """A body of concatenated pieces (protobuf merges them): requests, prompt messages of
    several packed id fields each, another member of the prompt's oneof (it clears the
    ids before it), unknown fields at both levels."""
    pieces = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["request", "prompt", "prompt", "sibling", "unknown"]))
        if kind == "request":
            request = _other_fields(type_, draw)
            type_.ids(request).extend(draw(id_lists))
            pieces.append(request.SerializeToString())
        elif kind == "prompt":
            inner = [_field(type_.field.inner, b"".join(map(_varint, ids)))
                     for ids in draw(st.lists(wide_id_lists, max_size=3))]  # fmt: skip
            inner.append(draw(unknown_fields))
            pieces.append(_field(type_.field.outer, b"".join(inner)))
        elif kind == "sibling":
            pieces.append(type_.sibling().SerializeToString())
        else:
            pieces.append(draw(unknown_fields))
    return b"".join(pieces)


@pytest.mark.parametrize("service", sorted(TYPES))
@PROPERTY
@given(data=st.data())
def test_trimmed_decode_is_protobufs_parse_of_the_kept_ids(service, data):
    type_ = TYPES[service]
    body = data.draw(bodies(type_))
    max_ids = data.draw(st.integers(0, 40))
    _, num_ids = _expected(type_, body, max_ids)
    trimmed = _check_exact(type_, body, max_ids)
    if num_ids > max_ids:
        assert trimmed is not None


@pytest.mark.parametrize("service", sorted(TYPES))
@PROPERTY
@given(data=st.data())
def test_corrupt_bodies_are_left_to_protobuf(service, data):
    """Cut, overwritten or inserted bytes: the trimmed decode is protobuf's parse of the
    kept ids, or None (protobuf then parses, or refuses, the whole body)."""
    type_ = TYPES[service]
    body = bytearray(data.draw(bodies(type_)))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(body)))
        change = data.draw(st.sampled_from(["cut", "set", "insert"]))
        if change == "cut":
            del body[at:]
        elif change == "set" and at < len(body):
            body[at] = data.draw(st.integers(0, 255))
        else:
            body[at:at] = data.draw(st.binary(min_size=1, max_size=11))
    body = bytes(body)
    try:
        type_.parse(body)
    except Exception:
        assert wire.decode_trimmed(body, type_.field, 0, type_.parse) is None
    else:
        _check_exact(type_, body, data.draw(st.integers(0, 40)))


# ---- what the walk leaves to protobuf ---------------------------------------------


@pytest.mark.parametrize("service", sorted(TYPES))
def test_malformed_ids_in_the_dropped_part_are_left_to_protobuf(service):
    type_ = TYPES[service]
    ids = b"".join(map(_varint, range(50)))
    overlong = b"\x81" * 10 + b"\x01"  # 11 bytes: protobuf allows 10
    cut_off = b"\x81"  # the range ends inside a varint
    for bad in (ids[:7] + overlong + ids[7:], ids + cut_off):  # dropped: more ids follow
        body = _field(type_.field.outer, b"".join(_field(type_.field.inner, p) for p in (bad, ids)))
        with pytest.raises(Exception, match="parsing"):
            type_.parse(body)
        assert wire.decode_trimmed(body, type_.field, 4, type_.parse) is None
    # Ten bytes is the longest varint protobuf reads; it keeps the low 32 bits.
    longest = b"\xff" * 9 + b"\x01"
    for packed in (longest * 30 + ids, ids + longest * 30):
        body = _field(type_.field.outer, _field(type_.field.inner, packed))
        trimmed = _check_exact(type_, body, 4)
        assert trimmed is not None and trimmed.num_ids == 80


@pytest.mark.parametrize("service", sorted(TYPES))
def test_what_the_walk_does_not_expect_is_left_to_protobuf(service):
    type_ = TYPES[service]
    huge = _packed(type_, list(range(100)))
    unpacked = _field(type_.field.outer, _varint(type_.field.inner << 3) + b"\x05")
    group = _varint(90 << 3 | 3) + _varint(90 << 3 | 4)
    fixed32 = _varint(type_.field.outer << 3 | 5) + _field(type_.field.inner, b"\x05\x05")
    bad_tags = (_varint(0 << 3 | 0) + b"\x01", b"\xf8\xff\xff\xff\x7f\x01")  # field 0, 35 bits
    many_fields = _field(150, b"") * wire.MAX_FIELDS
    # Another member of the oneof, with a wire type protobuf keeps as an unknown field.
    unknown_sibling = _varint(min(type_.field.siblings) << 3 | 0) + b"\x01"
    for body in (
        unknown_sibling + huge,
        huge + unpacked,
        unpacked + huge,
        huge + group,
        huge + fixed32,  # protobuf keeps it as an unknown field
        *(bad + huge for bad in bad_tags),
        huge + many_fields,
    ):
        assert wire.decode_trimmed(body, type_.field, 4, type_.parse) is None
    assert wire.decode_trimmed(huge, type_.field, 100, type_.parse) is None  # nothing to drop
    assert _check_exact(type_, huge, 99) is not None


@pytest.mark.parametrize("service", sorted(TYPES))
def test_ids_another_member_of_the_oneof_clears_are_cut_whole(service):
    """Text before the ids (the issue's flood), ids before text, and ids on both sides:
    only the ids after the last other member count, and protobuf never sees the rest."""
    type_ = TYPES[service]
    sibling = type_.sibling().SerializeToString()
    first, second = _packed(type_, list(range(100))), _packed(type_, list(range(50, 60)))
    cases = {  # body -> (ids counted, ids kept of at most 4)
        sibling + first: (100, [96, 97, 98, 99]),
        first + sibling: (0, []),
        first + sibling + second: (10, [56, 57, 58, 59]),
        first + sibling + _packed(type_, [7, 8]): (2, [7, 8]),  # nothing kept is cut
    }
    for body, (num_ids, kept) in cases.items():
        trimmed = _check_exact(type_, body, 4)
        assert trimmed is not None and trimmed.num_ids == num_ids
        assert list(type_.ids(trimmed.message)) == kept
        assert len(trimmed.message.SerializeToString()) < 40  # the cleared ids are gone
    assert wire.decode_trimmed(sibling + second, type_.field, 10, type_.parse) is None


# ---- validation answers as for the whole list -------------------------------------


def _answer(type_: _Type, message: Message) -> object:
    try:
        return type_.validate(message)
    except InvalidArgument as exc:
        return str(exc)


@pytest.mark.parametrize("service", sorted(TYPES))
def test_validation_answers_as_for_the_whole_list(service):
    """The kept ids, or the refusal naming the real count ("got 40", "after ...
    truncate_prompt_tokens"), or the kept id out of range: as from a full parse."""
    type_ = TYPES[service]
    answers = set()
    for num_ids, truncate, last in itertools.product(
        (1, 7, 8, 9, 40), (None, -1, 0, 1, 7, 8, 39, 40, 41), (5, 100, 2**32 - 1)
    ):
        request = type_.message()
        sampling = request.sampling if service == "specserve.v1" else request.sampling_params
        if truncate is not None and (truncate >= 0 or service == "VllmEngine"):
            sampling.truncate_prompt_tokens = truncate
        type_.ids(request).extend([200] * (num_ids - 1) + [last])  # dropped ids out of range
        data = request.SerializeToString()
        whole = _answer(type_, type_.parse(data))
        trimmed = wire.decode_trimmed(data, type_.field, LIMITS.max_model_len, type_.parse)
        if num_ids <= LIMITS.max_model_len:
            assert trimmed is None
            continue
        assert trimmed is not None and type_.ids(trimmed.message)[-1] == last
        # As in the server: the guard unwraps it in the call's own context.
        answer = contextvars.copy_context().run(lambda: _answer(type_, wire.unwrap(trimmed)))  # noqa: B023
        assert answer == whole, (num_ids, truncate, last)
        answers.add(answer if isinstance(answer, str) else "ok")
        # Without its context (another call's), the message counts only its own ids.
        assert wire.num_prompt_ids(trimmed.message, type_.ids(trimmed.message)) == 8
    assert "ok" in answers and any("got 40" in a for a in answers)
    assert any("after sampling" in a for a in answers) and any("must be in" in a for a in answers)


# ---- the decode guard ---------------------------------------------------------------


GENERATE_METHODS = {
    "specserve.v1": "/specserve.v1.Generation/Generate",
    "VllmEngine": "/vllm.grpc.engine.VllmEngine/Generate",
}


@pytest.mark.parametrize("service", sorted(TYPES))
def test_the_guard_trims_large_bodies_only(service, monkeypatch):
    """Under LARGE_BODY_BYTES a body is parsed whole on the spot; from it on the handler
    decodes it in a worker thread, with only the ids validation can keep."""
    type_ = TYPES[service]
    method = GENERATE_METHODS[service]
    safe = decode_guard.request_decoder(method, type_.message.FromString, max_prompt_ids=lambda: 4)
    whole = decode_guard.request_decoder(method, type_.message.FromString)  # no limit known

    def decoded(deserialize, data: bytes):
        request = deserialize(data)
        assert isinstance(request, decode_guard.Deferred)
        return asyncio.run(decode_guard._decoded(request))

    body = _packed(type_, list(range(20)))
    assert type_.ids(safe(body)) == list(range(20))  # under LARGE_BODY_BYTES: parsed whole
    monkeypatch.setattr(body_policy, "LARGE_BODY_BYTES", 0)
    trimmed = decoded(safe, body)
    assert isinstance(trimmed, wire.Trimmed) and trimmed.num_ids == 20
    assert type_.ids(trimmed.message) == list(range(16, 20))
    assert type_.ids(decoded(whole, body)) == list(range(20))
    overlong = _field(type_.field.outer, _field(type_.field.inner, b"\x81" * 11 + body))
    for bad in (body[:-1], overlong):
        refused = decoded(safe, bad)
        assert isinstance(refused, Undecodable)
        assert refused.details == decoded(whole, bad).details
        name = type_.message.DESCRIPTOR.full_name
        assert refused.details.startswith(f"request body is not a valid {name}: ")
