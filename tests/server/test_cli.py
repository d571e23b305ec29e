"""The `specserve` command line: serve's flags, generate in both modes (local and
--server) with the same flags and defaults, help on every flag, --version."""

from __future__ import annotations

import argparse
import importlib.metadata
import re

import grpc
import pytest

from engine import version
from engine.client import SpecserveClient
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.entrypoints.args import add_engine_args, engine_config_from_args
from engine.entrypoints.cli import build_parser, iter_parsers, main
from engine.io.sampling_params import SamplingParams
from engine.server.app import ServerOptions
from tests.server.helpers import InProcessServer, free_port

STATS_LINE = re.compile(
    r"^\[(stop|length)\] (\d+) tokens, ttft \d+ ms, total \d+\.\d\d s, "
    r"drafts (\d+), accepted (\d+)$"
)


@pytest.fixture(scope="module")
def recording_server(engine_config):
    """A server on the real engine that remembers each request's params and prompt."""
    received: list[tuple[SamplingParams, object]] = []

    class RecordingEngine(LLMEngine):
        def add_request(self, request_id, prompt, params=None, **kwargs):
            received.append((params, kwargs.get("messages") or prompt))
            return super().add_request(request_id, prompt, params, **kwargs)

    with InProcessServer(engine_config, engine_factory=RecordingEngine) as srv:
        srv.received = received
        yield srv


def _received(server: InProcessServer) -> list[tuple[SamplingParams, object]]:
    return server.received


def _generate(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_serve_is_registered_with_documented_defaults():
    import engine.entrypoints.serve
    from engine.entrypoints.commands import COMMANDS

    assert COMMANDS["serve"][0] == "engine.entrypoints.serve"
    parser = argparse.ArgumentParser()
    engine.entrypoints.serve.add_arguments(parser)
    args = parser.parse_args(["--model", "m"])
    assert (args.host, args.port, args.shutdown_grace) == ("0.0.0.0", 50051, 30.0)
    assert (args.no_reflection, args.api_key, args.tls_cert) == (False, None, None)
    assert args.max_connection_age_s == 300.0 and args.model == "m"


def test_engine_flag_defaults_are_engine_config_defaults():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])) == EngineConfig()
    args = parser.parse_args(["--tokenizer", "tok", "--no-prefix-caching", "--block-size", "32"])
    config = engine_config_from_args(args)
    assert (config.tokenizer, config.enable_prefix_caching, config.block_size) == (
        "tok",
        False,
        32,
    )
    assert args.given_engine_flags == ("--tokenizer", "--no-prefix-caching", "--block-size")


def test_no_batch_invariance_reaches_the_engine_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert EngineConfig().batch_invariant is True
    config = engine_config_from_args(parser.parse_args(["--no-batch-invariance"]))
    assert config.batch_invariant is False


def test_speculation_and_constraint_flags_reach_the_engine_config():
    """Each of these flags, given a value other than its default, changes the
    EngineConfig field of its name (--spec-tree-max-nodes and --suffix-cache-mib were
    once parsed and dropped: an out-of-range value was silently ignored)."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    values = {
        "--spec-tree-max-nodes": ("7", 7),
        "--suffix-cache-mib": ("3.5", 3.5),
        "--structured-output-step-budget-ms": ("9", 9.0),
        "--structured-output-max-items": ("2000", 2000),
        "--num-speculative-tokens": ("6", 6),
    }
    for flag, (text, value) in values.items():
        config = engine_config_from_args(parser.parse_args([flag, text]))
        field = flag.removeprefix("--").replace("-", "_")
        assert getattr(config, field) == value, flag


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


def test_generate_server_sends_every_sampling_flag(recording_server, capsys):
    flags = ["--max-tokens", "5", "--temperature", "0.75", "--top-k", "3", "--top-p", "0.875"]
    flags += ["--min-p", "0.0625", "--seed", "11", "--stop", "zz", "--stop", "q!", "--ignore-eos"]
    code, out, err = _generate(capsys, "--server", recording_server.target, *flags, "Hello")
    assert (code, err) == (0, "")
    params, prompt = _received(recording_server)[-1]
    expected = SamplingParams(
        max_tokens=5,
        temperature=0.75,  # exact in the proto's float32
        top_k=3,
        top_p=0.875,
        min_p=0.0625,
        seed=11,
        stop=["zz", "q!"],
        ignore_eos=True,
    )
    assert params == expected
    with SpecserveClient(recording_server.target) as client:
        assert prompt in ("Hello", client.tokenize("Hello"))  # the text, or its ids
        chat = [{"role": "user", "content": "Hi"}]
        chat_ids = client.tokenize(messages=chat)
    assert out.endswith("\n")
    code, _out, _err = _generate(capsys, "--server", recording_server.target, "--chat", "Hi")
    assert code == 0
    assert _received(recording_server)[-1][1] in (chat, chat_ids)


def test_generate_defaults_are_the_api_defaults(recording_server, capsys):
    """One story: a request with no sampling flags is a request with no sampling fields."""
    assert _generate(capsys, "--server", recording_server.target, "Hello")[0] == 0
    params, _ = _received(recording_server)[-1]
    assert params == SamplingParams()
    generate = _subparser("generate")
    help_text = generate.format_help()
    api = SamplingParams()
    assert f"the most tokens to generate (default: {api.max_tokens})" in help_text
    assert f"0 is greedy decoding (default: {api.temperature})" in help_text
    args = generate.parse_args(["x"])
    assert (args.max_tokens, args.temperature, args.top_k, args.top_p, args.min_p) == (
        api.max_tokens,
        api.temperature,
        api.top_k,
        api.top_p,
        api.min_p,
    )


def test_generate_same_output_locally_and_with_server(server, engine_config, capsys):
    flags = ["--temperature", "0", "--max-tokens", "6", "--top-k", "5", "--ignore-eos", "--stats"]
    code, remote_out, remote_err = _generate(capsys, "--server", server.target, *flags, "Hello")
    assert code == 0
    with SpecserveClient(server.target) as client:
        expected = client.generate_complete(
            "Hello", max_tokens=6, temperature=0.0, top_k=5, ignore_eos=True
        )
    assert remote_out == expected.text + "\n"
    remote_stats = STATS_LINE.match(remote_err.strip())
    assert remote_stats is not None, remote_err
    assert remote_stats.group(1, 2) == ("length", "6")
    engine_flags = ["--model", engine_config.model, "--device", "cpu", "--num-kv-blocks", "64"]
    code, local_out, local_err = _generate(capsys, *engine_flags, *flags, "Hello")
    assert code == 0 and local_out == remote_out
    local_stats = STATS_LINE.match(local_err.strip().splitlines()[-1])
    assert local_stats is not None, local_err
    assert local_stats.group(1, 2) == ("length", "6")


def test_generate_stats_with_server_reads_usage(server, capsys):
    args = ["--server", server.target, "--temperature", "0", "--max-tokens", "4", "--ignore-eos"]
    code, _out, err = _generate(capsys, *args, "--stats", "Hello world")
    assert code == 0
    with SpecserveClient(server.target) as client:
        usage = client.generate_complete(
            "Hello world", max_tokens=4, temperature=0.0, ignore_eos=True
        ).usage
    match = STATS_LINE.match(err.strip())
    assert match is not None, err
    assert match.group(1, 2) == ("length", str(usage.completion_tokens))
    drafts, accepted = int(match.group(3)), int(match.group(4))
    assert 0 <= accepted <= drafts
    assert _generate(capsys, *args, "Hello world")[2] == ""  # no --stats: nothing


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--model", "/does/not/exist"], "--model is an engine flag and does"),
        (["--device", "auto"], "--device is an engine flag and does"),  # even the default
        (["--no-prefix-caching", "--dtype", "float32"], "--no-prefix-caching, --dtype are"),
        (["--tokenizer", "t", "--tokenizer", "u"], "--tokenizer is an engine flag and does"),
    ],
)
def test_engine_flags_with_server_are_refused(recording_server, capsys, flags, named):
    before = len(_received(recording_server))
    code, out, err = _generate(capsys, "--server", recording_server.target, *flags, "Hello")
    assert code == 2 and out == ""
    assert err.startswith(f"specserve generate: error: {named}")
    assert err.endswith("nothing with --server (the server already loaded its model)\n")
    assert err.count("\n") == 1
    assert len(_received(recording_server)) == before  # refused before any RPC


def test_generate_errors_are_one_line(server, capsys):
    code, _out, err = _generate(capsys, "--server", server.target, "--max-tokens", "0", "x")
    assert code == 2 and err == "specserve generate: error: max_tokens must be >= 1, got 0\n"
    code, _out, err = _generate(capsys, "--api-key", "k", "x")
    assert code == 2 and err == "specserve generate: error: --api-key only applies with --server\n"
    unreachable = f"127.0.0.1:{free_port()}"
    code, _out, err = _generate(capsys, "--server", unreachable, "x")
    assert code == 2 and err.startswith("specserve generate: error: UNAVAILABLE")
    assert err.count("\n") == 1


def _subparser(*path: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def test_every_flag_of_every_subcommand_has_help_and_shows_its_default():
    parsers = list(iter_parsers(build_parser()))
    assert {p.prog for p in parsers} >= {
        "specserve generate",
        "specserve serve",
        "specserve bench offline",
        "specserve bench serve",
    }
    for parser in parsers:
        help_text = parser.format_help()
        for action in parser._actions:
            name = action.option_strings or action.dest
            assert action.help and action.help.strip(), f"{parser.prog} {name}: no help"
            default = action.default
            says_something = default is not None and default is not False
            if action.option_strings and says_something and default != argparse.SUPPRESS:
                formatted = parser._get_formatter()._expand_help(action)
                assert "default" in formatted, f"{parser.prog} {name}: no default shown"
        assert "==SUPPRESS==" not in help_text


def test_version(capsys, monkeypatch):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"specserve {importlib.metadata.version('specserve')}\n"

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert version().startswith("unknown")


def test_no_reflection(engine_config):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    options = ServerOptions(host="127.0.0.1", port=0, reflection=False)
    with InProcessServer(engine_config, options) as srv, grpc.insecure_channel(srv.target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as info:
            list(stub.ServerReflectionInfo(iter([request]), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
