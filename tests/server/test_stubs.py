"""The committed stubs match the .proto, import from engine.rpc, and follow the API rules."""

from __future__ import annotations

import re
from pathlib import Path

from engine.rpc import generation_pb2 as pb
from engine.rpc import regen


def _without_tool_versions(text: str) -> str:
    """Drop what depends on the grpcio-tools release, not on the .proto."""
    text = re.sub(r"_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)", "", text)
    text = re.sub(r"^# Protobuf Python Version: .*$", "", text, flags=re.MULTILINE)
    return re.sub(r"^GRPC_GENERATED_VERSION = .*$", "", text, flags=re.MULTILINE)


def test_committed_stubs_match_regenerated(tmp_path: Path):
    for generated in regen.generate(tmp_path):
        committed = regen.RPC_DIR / generated.name
        assert committed.exists(), f"{committed.name} is missing: run python -m engine.rpc.regen"
        assert _without_tool_versions(committed.read_text()) == _without_tool_versions(
            generated.read_text()
        ), f"{committed.name} is stale: run python -m engine.rpc.regen"


def test_grpc_module_imports_from_engine_rpc():
    text = (regen.RPC_DIR / "generation_pb2_grpc.py").read_text()
    assert "from engine.rpc import generation_pb2" in text
    assert "from specserve" not in text


def test_every_enum_has_unspecified_zero():
    enums = list(pb.DESCRIPTOR.enum_types_by_name.values())
    for message in pb.DESCRIPTOR.message_types_by_name.values():
        enums.extend(message.enum_types)
    assert enums
    for enum in enums:
        zero = enum.values_by_number[0].name
        assert zero.endswith("UNSPECIFIED"), f"{enum.full_name}: zero value is {zero}"


def test_service_shape():
    service = pb.DESCRIPTOR.services_by_name["Generation"]
    assert service.full_name == "specserve.v1.Generation"
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {
        "Generate", "GenerateComplete", "Tokenize", "GetModelInfo", "GetServerStats",
    }  # fmt: skip
    assert methods["Generate"].server_streaming
    assert not methods["GenerateComplete"].server_streaming
