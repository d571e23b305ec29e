"""Parsing a large body a piece at a time (engine/server/wire_pieces.py): the result is
protobuf's parse of the whole body, its refusals are protobuf's, and protobuf is never
handed much more than PIECE_BYTES at once."""

from __future__ import annotations

import itertools

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from engine.rpc import generation_pb2 as pb
from engine.server import wire_pieces
from engine.server.wire_pieces import BodyRefused, parse_in_pieces

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MiB = 1 << 20
# What wrapping a piece in its enclosing fields' tags and lengths adds, three deep.
WRAPPING_BYTES = 3 * (5 + 5)


def _test_messages() -> tuple[type[Message], type[Message]]:
    """Inner and Outer: every kind of field the walk treats differently.

    message Inner {
      repeated uint32 ids = 1;  repeated string words = 2;  Inner child = 3;
      repeated float floats = 4;  repeated fixed64 wide = 5;  repeated sint64 signed = 6;
      map<int32, float> bias = 7;  repeated Inner items = 8;  bytes blob = 9;
      oneof pick { string text = 10; Inner other = 11; }
    }
    message Outer { Inner inner = 1; repeated Inner list = 2; string name = 3;
                    repeated double doubles = 4; }
    """
    f = descriptor_pb2.FieldDescriptorProto
    repeated, optional = f.LABEL_REPEATED, f.LABEL_OPTIONAL
    file = descriptor_pb2.FileDescriptorProto(name="pieces_test.proto", package="pieces",
                                              syntax="proto3")  # fmt: skip
    inner = file.message_type.add(name="Inner")
    inner.oneof_decl.add(name="pick")
    entry = inner.nested_type.add(name="BiasEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=f.TYPE_INT32, label=optional)
    entry.field.add(name="value", number=2, type=f.TYPE_FLOAT, label=optional)
    for name, number, type_, label, type_name in (
        ("ids", 1, f.TYPE_UINT32, repeated, None),
        ("words", 2, f.TYPE_STRING, repeated, None),
        ("child", 3, f.TYPE_MESSAGE, optional, ".pieces.Inner"),
        ("floats", 4, f.TYPE_FLOAT, repeated, None),
        ("wide", 5, f.TYPE_FIXED64, repeated, None),
        ("signed", 6, f.TYPE_SINT64, repeated, None),
        ("bias", 7, f.TYPE_MESSAGE, repeated, ".pieces.Inner.BiasEntry"),
        ("items", 8, f.TYPE_MESSAGE, repeated, ".pieces.Inner"),
        ("blob", 9, f.TYPE_BYTES, optional, None),
        ("text", 10, f.TYPE_STRING, optional, None),
        ("other", 11, f.TYPE_MESSAGE, optional, ".pieces.Inner"),
    ):
        field = inner.field.add(name=name, number=number, type=type_, label=label)
        if type_name:
            field.type_name = type_name
        if number in (10, 11):
            field.oneof_index = 0
    outer = file.message_type.add(name="Outer")
    for name, number, type_, label in (
        ("inner", 1, f.TYPE_MESSAGE, optional),
        ("list", 2, f.TYPE_MESSAGE, repeated),
        ("name", 3, f.TYPE_STRING, optional),
        ("doubles", 4, f.TYPE_DOUBLE, repeated),
    ):
        field = outer.field.add(name=name, number=number, type=type_, label=label)
        if type_ == f.TYPE_MESSAGE:
            field.type_name = ".pieces.Inner"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    classes = message_factory.GetMessageClassesForFiles([file.name], pool)
    return classes["pieces.Inner"], classes["pieces.Outer"]


Inner, Outer = _test_messages()


@st.composite
def inner_messages(draw, depth: int = 0) -> Message:
    message = Inner(
        ids=draw(st.lists(st.integers(0, 2**32 - 1), max_size=20)),
        words=draw(st.lists(st.text(max_size=5), max_size=5)),
        floats=draw(st.lists(st.floats(width=32, allow_nan=False), max_size=6)),
        wide=draw(st.lists(st.integers(0, 2**64 - 1), max_size=4)),
        signed=draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6)),
        bias=draw(
            st.dictionaries(st.integers(-5, 5), st.floats(width=32, allow_nan=False), max_size=4)
        ),  # fmt: skip
        blob=draw(st.binary(max_size=8)),
    )
    if draw(st.booleans()):
        message.text = draw(st.text(max_size=5))
    if depth < 2:
        if draw(st.booleans()):
            message.child.CopyFrom(draw(inner_messages(depth + 1)))
        message.items.extend(draw(st.lists(inner_messages(depth + 1), max_size=2)))
        if draw(st.booleans()):
            message.other.CopyFrom(draw(inner_messages(depth + 1)))
    return message


def _unknown(number: int, payload: bytes) -> bytes:
    return bytes([number << 3 | 2, len(payload)]) + payload


@st.composite
def bodies(draw) -> bytes:
    """Concatenated Outer messages (protobuf merges them), unknown fields between."""
    pieces = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.integers(0, 4)) == 0:
            pieces.append(_unknown(draw(st.integers(5, 15)), draw(st.binary(max_size=6))))
            continue
        outer = Outer(name=draw(st.text(max_size=4)),
                      doubles=draw(st.lists(st.floats(allow_nan=False), max_size=4)))  # fmt: skip
        if draw(st.booleans()):
            outer.inner.CopyFrom(draw(inner_messages()))
        outer.list.extend(draw(st.lists(inner_messages(1), max_size=2)))
        pieces.append(outer.SerializeToString())
    return b"".join(pieces)


def _parse(message_class: type[Message], data: bytes) -> Message | str:
    try:
        return message_class.FromString(data)
    except Exception as exc:
        return str(exc)


def _in_pieces(message_class: type[Message], data: bytes) -> Message | str:
    try:
        return parse_in_pieces(data, message_class)
    except BodyRefused:
        raise
    except Exception as exc:
        return str(exc)


def _same(a: Message | str, b: Message | str) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return a == b and a.SerializeToString() == b.SerializeToString()


@PROPERTY
@given(body=bodies(), piece_bytes=st.sampled_from([1, 5, 40, 1000]))
def test_the_pieces_parse_as_the_whole_body(body, piece_bytes):
    """Pieces as small as one byte: every message, packed list and run is split."""
    whole = _parse(Outer, body)
    assert not isinstance(whole, str)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wire_pieces, "PIECE_BYTES", piece_bytes)
        assert _same(_in_pieces(Outer, body), whole)


@pytest.mark.parametrize("piece_bytes", [1, 5])
def test_an_empty_sub_message_split_off_keeps_its_presence(piece_bytes):
    """A set but empty message field (b"\\n\\x00": inner {}) larger than a piece: split
    into no pieces it was dropped, and the request parsed without it (found by the
    property above)."""
    inner_set = Outer()
    inner_set.inner.SetInParent()
    body = inner_set.SerializeToString() + Outer(name="x").SerializeToString()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wire_pieces, "PIECE_BYTES", piece_bytes)
        parsed = parse_in_pieces(body, Outer)
    assert parsed.HasField("inner") and parsed == Outer.FromString(body)


@PROPERTY
@given(data=st.data(), piece_bytes=st.sampled_from([1, 5, 40]))
def test_corrupt_bodies_are_refused_as_protobuf_refuses_them(data, piece_bytes):
    """Cut, overwritten or inserted bytes: the same message, or a refusal where protobuf
    refuses the whole body (its reason may differ: parsing the whole body, upb checks a
    string's UTF-8 before it notices that the string runs past its message; a piece ends
    there). A group (wire type 3), which protobuf keeps as an unknown field, is refused."""
    body = bytearray(data.draw(bodies()))
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
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(wire_pieces, "PIECE_BYTES", piece_bytes)
            in_pieces = _in_pieces(Outer, body)
    except BodyRefused as exc:
        assert "group" in str(exc)
        return
    whole = _parse(Outer, body)
    if isinstance(whole, str):
        assert isinstance(in_pieces, str)
        assert in_pieces.startswith("Error parsing message with type 'pieces.Outer': ")
    else:
        assert _same(in_pieces, whole)


def _chat(num_messages: int) -> pb.GenerateRequest:
    request = pb.GenerateRequest()
    for i in range(num_messages):
        request.chat.messages.add(role="user", content=f"message {i} " * 80)
    return request


def _large_bodies() -> dict[str, tuple[type[Message], bytes]]:
    """About 2-14 MiB each, of the kinds a client may send."""
    ids = pb.GenerateRequest(sampling=pb.SamplingOptions(max_tokens=1))
    ids.token_ids.ids.extend(itertools.repeat(300, 5_000_000))
    sampling = pb.SamplingOptions(stop=[f"stop {i}" for i in range(4_000)],
                                  stop_token_ids=range(1_000_000),
                                  logit_bias={i: 0.5 for i in range(3_000)})  # fmt: skip
    vllm = vpb.GenerateRequest(request_id="r")
    vllm.tokenized.input_ids.extend(range(2_000_000))
    vllm_text = vpb.GenerateRequest(text="x" * (3 * MiB)).SerializeToString()
    return {
        "ids": (pb.GenerateRequest, ids.SerializeToString()),
        "text then ids": (pb.GenerateRequest, b"\x12\x01x" + ids.SerializeToString()),
        "chat": (pb.GenerateRequest, _chat(3_000).SerializeToString()),
        "tokenize chat": (
            pb.TokenizeRequest,
            pb.TokenizeRequest(chat=_chat(3_000).chat).SerializeToString(),
        ),  # fmt: skip
        "sampling lists": (
            pb.GenerateRequest,
            pb.GenerateRequest(sampling=sampling).SerializeToString(),
        ),  # fmt: skip
        "one long text": (
            pb.GenerateRequest,
            pb.GenerateRequest(text="y" * (14 * MiB)).SerializeToString(),
        ),  # fmt: skip
        "vllm text then ids": (vpb.GenerateRequest, vllm_text + vllm.SerializeToString()),
    }


class _Recorded:
    """A message class that records the size of every piece protobuf is handed."""

    def __init__(self, message_class: type[Message]) -> None:
        self.DESCRIPTOR = message_class.DESCRIPTOR
        self._class = message_class
        self.sizes: list[int] = []

    def __call__(self) -> _Recorded:
        self.message = self._class()
        return self

    def MergeFromString(self, piece: bytes) -> None:
        self.sizes.append(len(piece))
        self.message.MergeFromString(piece)


@pytest.mark.parametrize("name", list(_large_bodies()))
def test_large_bodies_reach_protobuf_a_piece_at_a_time(name):
    message_class, data = _large_bodies()[name]
    assert len(data) > 2 * MiB
    recorded = _Recorded(message_class)
    result = parse_in_pieces(data, recorded)
    assert _same(result.message, message_class.FromString(data))
    # A long string is one piece of its own: protobuf copies it, it is not split.
    num_strings = {"one long text": 1, "vllm text then ids": 1}.get(name, 0)
    oversize = [n for n in recorded.sizes if n > wire_pieces.PIECE_BYTES + WRAPPING_BYTES]
    assert len(oversize) == num_strings
    if not num_strings:
        assert len(recorded.sizes) >= len(data) // wire_pieces.PIECE_BYTES


def test_bodies_the_walk_would_take_seconds_over_are_refused():
    """More fields than MAX_FIELDS in messages larger than a piece, or a group."""
    many = pb.GenerateRequest(sampling=pb.SamplingOptions(stop=["x"] * 100_000))
    with pytest.raises(BodyRefused) as info:
        parse_in_pieces(many.SerializeToString(), pb.GenerateRequest)
    assert str(info.value) == (
        "request body must have at most 8192 fields outside packed lists when it is "
        f"1048576 bytes or more, got more in {many.ByteSize()} bytes"
    )
    group = b"\x4b\x4c"  # field 9, start and end of a group: protobuf keeps it, unknown
    body = group + pb.GenerateRequest(text="x" * MiB).SerializeToString()
    assert pb.GenerateRequest.FromString(body).text == "x" * MiB
    with pytest.raises(BodyRefused, match=r"^request body must hold no group \(wire type 3\)"):
        parse_in_pieces(body, pb.GenerateRequest)
