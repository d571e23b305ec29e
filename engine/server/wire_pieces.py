"""Parsing a large request body a piece at a time, so that no protobuf call holds the GIL
for long.

A worker thread parsing a 14 MiB body holds the GIL as long as protobuf runs: 55-85 ms
for millions of ids, stop strings or chat messages, and six such bodies at once kept
health waiting 0.4-0.8 s although no byte was parsed on the event loop. Protobuf parses
a concatenation of serialized messages as their merge, and a singular message field
given twice as the merge of the two, so ``parse_in_pieces`` walks the body's fields and
hands protobuf pieces of about PIECE_BYTES each:

    body:    a b sampling{c stop stop stop ... stop} d          (sampling: 14 MiB)
    pieces:  [a b] [sampling{c stop ...}] [sampling{stop ...}] ... [d]

A run of small fields is one piece; a field larger than PIECE_BYTES is split where
splitting keeps protobuf's answer: a singular message field into its own fields (each
piece wrapped in the field's tag), a packed list of numbers between two values. Other
large fields (a string, a repeated message's element, an unknown field) are handed
whole: protobuf copies those, it does not parse them item by item.

The result is protobuf's parse of the whole body. Protobuf sees the bytes in order and
refuses a corrupt body as it would refuse it whole (its reason may differ: parsing the
whole body, upb checks a string's UTF-8 before it notices that the string runs past its
message, while a piece ends there). A body whose walk would visit more than MAX_FIELDS
fields, or that holds a group, is refused (``BodyRefused``): walking millions of tiny
fields in Python costs seconds, and no request needs either.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from engine.server.body_policy import LARGE_BODY_BYTES
from engine.server.wire_format import (
    MAX_VARINT_BYTES,
    Corrupt,
    Field,
    Unexpected,
    read_field,
    varint_bytes,
    wire_type_of,
)

# About what protobuf parses in 1-2 ms: the longest the GIL is held at a time.
PIECE_BYTES = 256 << 10
# The most fields a walk visits, ~10 ms of Python: four times what validation lets a
# request keep (1024 chat messages, 1024 logit_bias entries, 16 stop strings, ...). Only
# fields of messages larger than PIECE_BYTES count; a packed list counts as one.
MAX_FIELDS = 8192
# The walk lets other threads take the GIL this often (fields) and after every piece:
# a thread that never waits keeps the event loop and the engine waiting 5 ms for each
# turn they get (sys.getswitchinterval).
YIELD_EVERY = 256
# Singular messages nested deeper than this are handed whole.
MAX_DEPTH = 8
# A packed number's wire type -> its size in bytes (0: a varint).
_VALUE_SIZES = {0: 0, 1: 8, 5: 4}


class BodyRefused(ValueError):
    """A large body the walk will not split; the message is one line."""


def parse_in_pieces(data: bytes, message_class: type[Message]) -> Message:
    """``message_class.FromString(data)``, protobuf handed at most about PIECE_BYTES at a
    time (more only for a single field it copies); raises as FromString does, or
    BodyRefused."""
    message = message_class()
    budget = [MAX_FIELDS]
    try:
        for piece in _pieces(data, 0, len(data), message_class.DESCRIPTOR, budget, 0):
            message.MergeFromString(piece)
            time.sleep(0)
    except Unexpected as exc:
        raise BodyRefused(_refusal(str(exc), len(data))) from None
    return message


def _refusal(reason: str, num_bytes: int) -> str:
    large = f"when it is {LARGE_BODY_BYTES} bytes or more"
    if reason == "group":
        return f"request body must hold no group (wire type 3) {large}, got {num_bytes} bytes"
    return (
        f"request body must have at most {MAX_FIELDS} fields outside packed lists {large}, "
        f"got more in {num_bytes} bytes"
    )


def _pieces(
    data: bytes, start: int, end: int, descriptor: Descriptor, budget: list[int], depth: int
) -> Iterator[bytes]:
    """Pieces of data[start:end], the fields of a ``descriptor`` message, in order."""
    run = pos = start  # the run of small fields so far: data[run:pos]
    while pos < end:
        try:
            field = read_field(data, pos, end)
        except Corrupt:
            break  # the run goes on to the end, where protobuf refuses these bytes
        budget[0] -= 1
        if budget[0] < 0:
            raise Unexpected("too many fields")
        if budget[0] % YIELD_EVERY == 0:
            time.sleep(0)
        size = field.end - field.start
        split = _split(data, field, descriptor, budget, depth) if size > PIECE_BYTES else None
        if split is not None or field.end - run > PIECE_BYTES:
            if pos > run:
                yield data[run:pos]
            run = pos
        if split is not None:
            yield from split
            run = field.end
        pos = field.end
    if end > run or start == end:  # an empty message is one empty piece: its presence
        yield data[run:end]


def _split(
    data: bytes, field: Field, descriptor: Descriptor, budget: list[int], depth: int
) -> Iterator[bytes] | None:
    """Pieces of one large field, each a field of its own, whose merge is the field; None
    where it is handed whole."""
    declared = descriptor.fields_by_number.get(field.number)
    if declared is None or field.wire_type != 2:
        return None  # unknown, or a wire type protobuf keeps as an unknown field
    tag = data[field.start : field.value]
    if declared.type == FieldDescriptor.TYPE_MESSAGE:
        if declared.is_repeated or depth >= MAX_DEPTH:
            return None  # each occurrence is an element of its own
        pieces = _pieces(data, field.payload, field.end, declared.message_type, budget, depth + 1)
    elif declared.is_repeated and wire_type_of(declared) in _VALUE_SIZES:
        pieces = _packed_pieces(data, field.payload, field.end, wire_type_of(declared))
    else:
        return None  # a string or bytes: copied, not parsed
    return (tag + varint_bytes(len(piece)) + piece for piece in pieces)


def _packed_pieces(data: bytes, start: int, end: int, wire_type: int) -> Iterator[bytes]:
    """data[start:end], a packed list, cut between values about every PIECE_BYTES."""
    size = _VALUE_SIZES[wire_type]
    while end - start > PIECE_BYTES:
        if size:
            cut = start + max(size, PIECE_BYTES - PIECE_BYTES % size)
        else:  # after the last byte under 0x80 (a varint's last) before the cut
            window = max(start, start + PIECE_BYTES - MAX_VARINT_BYTES)
            tail = np.frombuffer(data, np.uint8, start + PIECE_BYTES - window, window)
            ends = np.flatnonzero(tail < 0x80)
            if len(ends) == 0:
                break  # a varint longer than protobuf reads: it refuses the rest
            cut = window + int(ends[-1]) + 1
        yield data[start:cut]
        start = cut
    yield data[start:end]
