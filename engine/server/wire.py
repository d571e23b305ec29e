"""Decoding a request with a huge prompt-id list without handing every id to protobuf.

grpc.aio deserializes each request on the event loop before any handler runs, and
protobuf holds the GIL 0.1-0.2 s for a 14 MiB body of 15M packed ids: six of them at once
kept health waiting up to a second. Validation never keeps more than max_model_len - 1
ids (the last ones), so for large bodies ``decode_trimmed`` walks the wire format to the
packed id field, counts its ids with numpy (every varint ends at a byte under 0x80), and
hands protobuf the body with only the last ``max_ids`` ids in it. Validation reads the
count the wire carried from ``num_prompt_ids``, so its answers ("got 15000000", the
"after truncate_prompt_tokens" wording, ids out of range) stay those of a full parse.
Ids that a later member of the prompt's oneof clears (a text field after them) are cut
whole: protobuf would parse them only to drop them.

Anything the walk does not expect (unpacked ids, groups, a malformed varint, more fields
than a request has) leaves the whole body to the parse, as does a reduced body it
refuses: which path decoded a request never changes the answer.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from google.protobuf.message import Message
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from engine.rpc import generation_pb2 as pb
from engine.server.wire_format import (
    MAX_VARINT_BYTES,
    Field,
    Unexpected,
    fields,
    varint_bytes,
    wire_type_of,
)

# Fields the walk reads at most, all messages together (a request has a few dozen).
MAX_FIELDS = 1024


@dataclass(frozen=True, slots=True)
class PromptField:
    """Where a request type keeps its prompt ids: packed repeated uint32 field ``inner``
    of the message in field ``outer``, a member of a oneof with ``siblings`` (field
    number -> wire type)."""

    outer: int
    inner: int
    siblings: dict[int, int]

    @classmethod
    def of(cls, message_class: type[Message], path: str) -> PromptField:
        outer_name, inner_name = path.split(".")
        outer = message_class.DESCRIPTOR.fields_by_name[outer_name]
        inner = outer.message_type.fields_by_name[inner_name]
        members = outer.containing_oneof.fields if outer.containing_oneof else ()
        siblings = {f.number: wire_type_of(f) for f in members if f is not outer}
        return cls(outer.number, inner.number, siblings)


# Request type (full name) -> its prompt ids.
PROMPT_FIELDS = {
    pb.GenerateRequest.DESCRIPTOR.full_name: PromptField.of(pb.GenerateRequest, "token_ids.ids"),
    vpb.GenerateRequest.DESCRIPTOR.full_name: PromptField.of(
        vpb.GenerateRequest, "tokenized.input_ids"
    ),
}


@dataclass(frozen=True, slots=True)
class Trimmed:
    """A request decoded with only the last of its prompt ids; ``num_ids`` is how many
    the wire carried."""

    message: Message
    num_ids: int


# The trimmed request of the current call and its wire count (see ``unwrap``).
_TRIMMED: contextvars.ContextVar[Trimmed | None] = contextvars.ContextVar(
    "trimmed_request", default=None
)


def unwrap(request: Any) -> Any:
    """The message a handler receives for ``request``. A ``Trimmed`` one's count is
    recorded in the call's context (each grpc.aio call runs in a task of its own) for
    ``num_prompt_ids``."""
    if not isinstance(request, Trimmed):
        return request
    _TRIMMED.set(request)
    return request.message


def num_prompt_ids(request: Message, ids: Sequence[int]) -> int:
    """How many prompt ids ``request`` carried: ``len(ids)``, or the wire's count when it
    was decoded with only the last of them."""
    trimmed = _TRIMMED.get()
    if trimmed is not None and trimmed.message is request:
        return trimmed.num_ids
    return len(ids)


class _Occurrence(NamedTuple):
    """One occurrence of the prompt message: its packed id fields, and whether a later
    member of the oneof clears it (protobuf merges the occurrences that follow it)."""

    outer: Field
    packed: list[Field]
    cleared: bool


def decode_trimmed(
    data: bytes, field: PromptField, max_ids: int, parse: Callable[[bytes], Message]
) -> Trimmed | None:
    """``data`` parsed by ``parse`` with only the prompt ids validation can keep: the
    last ``max_ids`` of those no later member of the oneof clears. None when there is
    nothing to cut, or anything the walk leaves to a whole parse."""
    try:
        occurrences = _prompt_occurrences(data, field)
        counts = [[_count_ids(data, ids.payload, ids.end) for ids in o.packed]
                  for o in occurrences]  # fmt: skip
    except Unexpected:
        return None
    live = [(ids, count) for o, n in zip(occurrences, counts) if not o.cleared
            for ids, count in zip(o.packed, n)]  # fmt: skip
    num_ids = sum(count for _, count in live)
    num_cleared = sum(sum(n) for o, n in zip(occurrences, counts) if o.cleared)
    if num_ids <= max_ids and num_cleared == 0:
        return None
    kept = iter(_kept_starts(data, [ids for ids, _ in live], [c for _, c in live], max_ids))
    starts = [ids.end if o.cleared else next(kept) for o in occurrences for ids in o.packed]
    try:
        message = parse(_reduced(data, occurrences, starts))
    except Exception:
        return None  # the whole parse names what is wrong
    return Trimmed(message, num_ids)


def _prompt_occurrences(data: bytes, field: PromptField) -> list[_Occurrence]:
    """Every occurrence of the prompt message, with its packed id fields."""
    top = fields(data, 0, len(data), MAX_FIELDS)
    budget = MAX_FIELDS - len(top)
    last_sibling = -1  # setting another member of the oneof clears the prompt
    for i, f in enumerate(top):
        if f.number in field.siblings:
            if f.wire_type != field.siblings[f.number]:
                raise Unexpected  # an unknown field to protobuf, which clears nothing
            last_sibling = i
    occurrences = []
    for i, outer in enumerate(top):
        if outer.number != field.outer:
            continue
        if outer.wire_type != 2:
            raise Unexpected
        inner = fields(data, outer.payload, outer.end, budget)
        budget -= len(inner)
        packed = [f for f in inner if f.number == field.inner]
        if any(f.wire_type != 2 for f in packed):
            raise Unexpected  # unpacked ids: one field each
        occurrences.append(_Occurrence(outer, packed, i < last_sibling))
    return occurrences


def _count_ids(data: bytes, start: int, end: int) -> int:
    """How many varints data[start:end] packs; raises where protobuf would refuse them
    (the last one cut off, or one longer than 10 bytes)."""
    if start == end:
        return 0
    if data[end - 1] >= 0x80:
        raise Unexpected
    high = np.frombuffer(data, np.uint8, end - start, start) >= 0x80
    num_high = int(np.count_nonzero(high))
    if num_high >= MAX_VARINT_BYTES and _has_overlong_varint(high):
        raise Unexpected
    return (end - start) - num_high


def _has_overlong_varint(high: np.ndarray) -> bool:
    """Whether ``high`` (a byte's high bit, per byte) has 10 set in a row. Any such run
    covers an aligned group of 4, so the exact search runs only where one is all set."""
    words = high[: len(high) // 4 * 4].view(np.uint32)
    if not np.any(words == 0x01010101):
        return False
    return high.view(np.uint8).tobytes().find(b"\x01" * MAX_VARINT_BYTES) >= 0


def _kept_starts(data: bytes, ranges: list[Field], counts: list[int], max_ids: int) -> list[int]:
    """Where the kept ids start in each packed range: the last ``max_ids`` of them all."""
    starts = []
    need = max_ids
    for ids, count in zip(reversed(ranges), reversed(counts)):
        if need >= count:
            starts.append(ids.payload)
            need -= count
        elif need == 0:
            starts.append(ids.end)
        else:
            # The last `need` ids take at most 10 bytes each; the id before them ends
            # within the window.
            window = max(ids.payload, ids.end - MAX_VARINT_BYTES * need - 1)
            tail = np.frombuffer(data, np.uint8, ids.end - window, window)
            ends = np.flatnonzero(tail < 0x80)
            starts.append(window + int(ends[-need - 1]) + 1)
            need = 0
    return starts[::-1]


def _reduced(data: bytes, occurrences: list[_Occurrence], starts: list[int]) -> bytes:
    """``data`` with each packed range cut to data[start:end], length prefixes rewritten
    (the range's and its message's); every other byte as it came."""
    pieces = []
    last = 0
    kept = iter(starts)
    for outer, packed, _ in occurrences:
        contents = []
        inner_last = outer.payload
        for ids in packed:
            start = next(kept)
            contents += [data[inner_last : ids.value], varint_bytes(ids.end - start)]
            contents.append(data[start : ids.end])
            inner_last = ids.end
        contents.append(data[inner_last : outer.end])
        body = b"".join(contents)
        pieces += [data[last : outer.value], varint_bytes(len(body)), body]
        last = outer.end
    pieces.append(data[last:])
    return b"".join(pieces)
