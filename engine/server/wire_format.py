"""Reading protobuf's wire format a field at a time, without protobuf: what the decode
guard needs to cut a large body's prompt ids (wire.py) or to hand protobuf a large body
a piece at a time (wire_pieces.py).

The walk stops where protobuf would refuse the bytes (``Corrupt``: upb refuses exactly
these, and stops there) and at what it does not read (``Unexpected``: groups).
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.descriptor import FieldDescriptor

MAX_VARINT_BYTES = 10
# upb refuses tags and length prefixes longer than this.
MAX_TAG_BYTES = 5

_FIXED_SIZES = {1: 8, 5: 4}  # wire type -> bytes
_FIXED32_TYPES = {FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_SFIXED32,
                  FieldDescriptor.TYPE_FLOAT}  # fmt: skip
_FIXED64_TYPES = {FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64,
                  FieldDescriptor.TYPE_DOUBLE}  # fmt: skip
_LENGTH_TYPES = {FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_STRING,
                 FieldDescriptor.TYPE_BYTES}  # fmt: skip


class Unexpected(Exception):
    """Something a walk does not read: it leaves the bytes to protobuf."""


class Corrupt(Unexpected):
    """Bytes protobuf refuses, at the position the walk reached: a varint longer than 10
    bytes (a tag or length longer than 5), a field past the end, an end of group without
    its start, wire type 6 or 7."""


@dataclass(frozen=True, slots=True)
class Field:
    """One field on the wire: its tag starts at ``start``, its value (a length prefix for
    wire type 2) at ``value``; the contents of a length-delimited one at ``payload``; it
    ends at ``end``."""

    number: int
    wire_type: int
    start: int
    value: int
    payload: int
    end: int


def read_field(data: bytes, pos: int, end: int) -> Field:
    """The field whose tag starts at ``pos``. A tag protobuf refuses that the walk can
    step over (field 0, over 32 bits) is read: protobuf refuses it where it is parsed."""
    tag, value = varint(data, pos, end, MAX_TAG_BYTES)
    number, wire_type = tag >> 3, tag & 7
    payload = value
    if wire_type == 0:
        _, next_pos = varint(data, value, end, MAX_VARINT_BYTES)
    elif wire_type in _FIXED_SIZES:
        next_pos = value + _FIXED_SIZES[wire_type]
    elif wire_type == 2:
        length, payload = varint(data, value, end, MAX_TAG_BYTES)
        next_pos = payload + length
    elif wire_type == 3:
        raise Unexpected("group")
    else:
        raise Corrupt
    if next_pos > end:
        raise Corrupt
    return Field(number, wire_type, pos, value, payload, next_pos)


def fields(data: bytes, start: int, end: int, budget: int) -> list[Field]:
    """The fields of data[start:end]; Unexpected past ``budget`` of them."""
    found = []
    pos = start
    while pos < end:
        if len(found) == budget:
            raise Unexpected("too many fields")
        found.append(read_field(data, pos, end))
        pos = found[-1].end
    return found


def varint(data: bytes, pos: int, end: int, max_bytes: int) -> tuple[int, int]:
    """(value, the position after it)."""
    value = shift = 0
    for i in range(pos, min(end, pos + max_bytes)):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    raise Corrupt


def varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def wire_type_of(field: FieldDescriptor) -> int:
    """The wire type of one value of ``field`` (a repeated number packs into type 2)."""
    if field.type in _LENGTH_TYPES:
        return 2
    if field.type in _FIXED32_TYPES:
        return 5
    if field.type in _FIXED64_TYPES:
        return 1
    if field.type == FieldDescriptor.TYPE_GROUP:
        return 3
    return 0  # varints: ints, bools, enums
