"""What the decode guard does with each RPC's request bodies, by method: the same for
every service the server registers, and for any method added later.

- UNPARSED: methods this server answers UNIMPLEMENTED whatever the request says. Their
  bodies are never parsed; the handler gets an empty request.
- LARGE: methods whose requests carry prompts, which may be large. A body of
  LARGE_BODY_BYTES or more is decoded in a worker thread a piece at a time, prompt ids
  cut to those validation can keep (wire.py, wire_pieces.py).
- SMALL: every other method. A body of LARGE_BODY_BYTES or more is refused unparsed,
  INVALID_ARGUMENT naming its size and the limit.
"""

from __future__ import annotations

import enum

from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from engine.rpc import generation_pb2 as pb

# Under this, protobuf parses any body in a few ms.
LARGE_BODY_BYTES = 1 << 20

_GENERATION = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_VLLM = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name


class BodyPolicy(enum.Enum):
    UNPARSED = "unparsed"
    LARGE = "large"
    SMALL = "small"


# The methods VllmEngineServicer answers UNIMPLEMENTED (tests/server/test_body_policy.py
# checks that these and no others do).
UNPARSED_METHODS = frozenset(
    f"/{_VLLM}/{name}" for name in ("Embed", "StartProfile", "StopProfile")
)
LARGE_BODY_METHODS = frozenset(
    [f"/{_GENERATION}/{name}" for name in ("Generate", "GenerateComplete", "Tokenize")]
    + [f"/{_VLLM}/Generate"]
)


def body_policy(method: str) -> BodyPolicy:
    """The policy for ``method`` ("/package.Service/Method")."""
    if method in UNPARSED_METHODS:
        return BodyPolicy.UNPARSED
    if method in LARGE_BODY_METHODS:
        return BodyPolicy.LARGE
    return BodyPolicy.SMALL


def too_large(method: str, num_bytes: int) -> str:
    """The refusal of a SMALL method's body of ``num_bytes``: one line."""
    return f"request body must be under {LARGE_BODY_BYTES} bytes for {method}, got {num_bytes}"
