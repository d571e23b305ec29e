"""`specserve serve` flags, the client CLI helper, reflection switch, one-line logging."""

from __future__ import annotations

import argparse

import grpc
import pytest

from engine.client import SpecserveClient, stream_generate_cli
from engine.server.app import ServerOptions
from tests.server.helpers import InProcessServer, free_port


def test_serve_is_registered_with_documented_defaults():
    import engine.cmd_serve
    from engine.cli import _COMMANDS

    assert "serve" in _COMMANDS
    parser = argparse.ArgumentParser()
    engine.cmd_serve.add_arguments(parser)
    args = parser.parse_args(["--model", "m"])
    assert (args.host, args.port, args.shutdown_grace) == ("0.0.0.0", 50051, 30.0)
    assert (args.no_reflection, args.api_key, args.tls_cert) == (False, None, None)
    assert args.max_connection_age_s == 300.0 and args.model == "m"


def test_server_options_validate_and_map_to_grpc_options():
    options = dict(ServerOptions().grpc_options())
    assert options["grpc.max_connection_age_ms"] == 300_000
    assert options["grpc.max_receive_message_length"] == 16 << 20
    assert options["grpc.keepalive_time_ms"] == 60_000
    assert ServerOptions(host="::1", port=1).address == "[::1]:1"
    with pytest.raises(ValueError, match="port"):
        ServerOptions(port=70000)
    with pytest.raises(ValueError, match="max_connection_age_s"):
        ServerOptions(max_connection_age_s=0)


def test_stream_generate_cli(server: InProcessServer, capsys):
    assert stream_generate_cli(server.target, "Hello", 5, 0.0, None, False, None) == 0
    with SpecserveClient(server.target) as client:
        expected = client.generate_complete("Hello", max_tokens=5, temperature=0.0).text
    assert capsys.readouterr().out == expected + "\n"
    assert stream_generate_cli(server.target, "Hello", 3, 0.7, 1, True, None) == 0
    assert stream_generate_cli(server.target, "Hello", 0, 0.0, None, False, None) == 1
    err = capsys.readouterr().err
    assert err.startswith("specserve generate: INVALID_ARGUMENT: sampling.max_tokens")
    assert err.count("\n") == 1
    unreachable = f"127.0.0.1:{free_port()}"
    assert stream_generate_cli(unreachable, "Hello", 3, 0.0, None, False, None) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_no_reflection(engine_config):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    options = ServerOptions(host="127.0.0.1", port=0, reflection=False)
    with InProcessServer(engine_config, options) as srv, grpc.insecure_channel(srv.target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as info:
            list(stub.ServerReflectionInfo(iter([request]), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
