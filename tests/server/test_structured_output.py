"""Structured output through both services: every constraint member of
vllm.grpc.engine.VllmEngine's oneof and of specserve.v1's StructuredOutput reaches the
engine and holds on the output, a speculating server gives what the plain engine gives,
and what does not compile is INVALID_ARGUMENT with the compiler's words, within the
compile-time limit, leaving nothing behind."""

from __future__ import annotations

import dataclasses
import json
import re
import threading

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from engine.client import SpecserveClient
from engine.io.sampling_params import SamplingParams, StructuredOutput
from engine.sample.grammar import GrammarCompiler
from tests.engine.engine_helpers import make_engine, run_to_completion
from tests.server.helpers import InProcessServer, wait_no_blocks_in_use

PROMPT = [5, 9, 14, 3, 9, 27, 9, 27]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["x", "y"]}},
    "required": ["ok", "tag"],
    "additionalProperties": False,
}
# (specserve.v1 client dict, the check on the text)
CONSTRAINTS = [
    ({"json_schema": SCHEMA}, lambda s: set(json.loads(s)) == {"ok", "tag"}),
    ({"regex": "[a-c]{4}!"}, lambda s: re.fullmatch("[a-c]{4}!", s)),
    ({"choice": ["north", "south"]}, lambda s: s in ("north", "south")),
    ({"grammar": 'root ::= "k" [0-9] [0-9]'}, lambda s: re.fullmatch("k[0-9]{2}", s)),
    ({"json_object": True}, lambda s: isinstance(json.loads(s), dict)),
]


@pytest.fixture(scope="module")
def spec_server(engine_config):
    config = dataclasses.replace(
        engine_config, speculative_method="ngram", speculative_disable_batch_size=64
    )
    with InProcessServer(config) as srv:
        yield srv


@pytest.fixture()
def client(spec_server):
    with SpecserveClient(spec_server.target) as c:
        yield c


def _plain(model_dir, constraint: dict, **kw) -> list[int]:
    params = SamplingParams(structured_output=constraint, **kw)
    engine = make_engine(str(model_dir), dtype="auto")  # the servers' dtype
    return run_to_completion(engine, {0: [("r", PROMPT, params)]})["r"]["token_ids"]


@pytest.mark.parametrize(("constraint", "check"), CONSTRAINTS)
def test_specserve_v1_constraints_hold_and_match_the_plain_engine(
    client, model_dir, constraint, check
):
    kw = {"max_tokens": 60, "temperature": 0.0}
    expected = _plain(model_dir, constraint, **kw)
    deltas = list(client.generate(PROMPT, structured_output=constraint, **kw))
    assert [t for d in deltas for t in d.token_ids] == expected
    text = "".join(d.text for d in deltas)
    assert check(text), text
    assert deltas[-1].finish_reason == "stop"
    assert deltas[-1].finish_detail is None
    wait_no_blocks_in_use(client)


def test_an_incomplete_output_says_so(client):
    reply = client.generate_complete(
        PROMPT, max_tokens=3, temperature=0.0, structured_output={"regex": "z{10}"}
    )
    assert reply.text == "zzz" and reply.finish_reason == "length"
    assert reply.finish_detail.startswith("structured output incomplete")


@pytest.mark.parametrize(
    ("constraint", "details"),
    [
        ({"regex": "(a"}, "structured_output.regex: "),
        ({"json_schema": '{"type": "objekt"}'}, "structured_output.json_schema: Invalid type"),
        ({"json_schema": "{"}, "sampling.structured_output.json_schema is not JSON"),
        ({"choice": []}, "sampling.structured_output.choice must hold 1 to 256 strings"),
        ({"grammar": 'root ::= "a" nope'}, "structured_output.grammar: Rule 'nope' not found"),
        ({"json_object": False}, "sampling.structured_output.json_object must be true"),
    ],
)
def test_bad_constraints_are_invalid_argument_with_the_compilers_words(client, constraint, details):
    for call in (client.generate_complete, lambda *a, **k: list(client.generate(*a, **k))):
        with pytest.raises(grpc.RpcError) as info:
            call(PROMPT, max_tokens=4, structured_output=constraint)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(details), info.value.details()
        assert "\n" not in info.value.details()
    wait_no_blocks_in_use(client)


def test_a_constraint_slower_than_the_limit_is_refused_and_the_server_serves_on(
    engine_config, monkeypatch
):
    """The compile runs beside the loop; past SPECSERVE_GRAMMAR_COMPILE_TIMEOUT_S the
    request is INVALID_ARGUMENT naming the limit, and other requests (health included)
    are served meanwhile."""
    monkeypatch.setenv("SPECSERVE_GRAMMAR_COMPILE_TIMEOUT_S", "0.5")
    real = GrammarCompiler.grammar
    release = threading.Event()  # the slow compile ends only when the test says so

    def slow(self, constraint):
        if constraint.regex == "slow":
            release.wait(60)
        return real(self, constraint)

    monkeypatch.setattr(GrammarCompiler, "grammar", slow)
    with InProcessServer(engine_config) as srv, SpecserveClient(srv.target) as c:
        with pytest.raises(grpc.RpcError) as info:
            c.generate_complete(
                PROMPT, max_tokens=4, structured_output={"regex": "slow"}, timeout=30
            )
        # Refused while the compile still runs: ordering, not a wall-clock bound.
        assert not release.is_set()
        release.set()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "took longer than 0.5 s to compile" in info.value.details()
        assert c.generate_complete(PROMPT, max_tokens=3, temperature=0.0).token_ids


VLLM_CONSTRAINTS = [
    (vpb.SamplingParams(json_schema=json.dumps(SCHEMA)), CONSTRAINTS[0][1]),
    (vpb.SamplingParams(regex="[a-c]{4}!"), CONSTRAINTS[1][1]),
    (
        vpb.SamplingParams(choice=vpb.ChoiceConstraint(choices=["north", "south"])),
        CONSTRAINTS[2][1],
    ),
    (vpb.SamplingParams(grammar='root ::= "k" [0-9] [0-9]'), CONSTRAINTS[3][1]),
    (vpb.SamplingParams(json_object=True), CONSTRAINTS[4][1]),
]


@pytest.mark.parametrize(("sampling", "check"), VLLM_CONSTRAINTS)
def test_every_member_of_the_vllm_constraint_oneof_is_served(spec_server, sampling, check):
    sampling.MergeFrom(vpb.SamplingParams(temperature=0.0, max_tokens=60))
    request = vpb.GenerateRequest(sampling_params=sampling, stream=False)
    request.tokenized.input_ids.extend(PROMPT)
    with grpc.insecure_channel(spec_server.target) as channel:
        replies = list(vpb_grpc.VllmEngineStub(channel).Generate(request, timeout=60))
    (complete,) = [r.complete for r in replies if r.HasField("complete")]
    from tests.tiny_models import make_tokenizer

    text = make_tokenizer().decode(list(complete.output_ids), skip_special_tokens=True)
    assert check(text), text
    assert complete.finish_reason == "stop"


def test_a_structural_tag_constrains_only_inside_its_structure(model_dir):
    """Free text until the trigger appears, then the structure: its begin, the schema,
    its end. (The tiny model never writes the trigger itself, so this drives the
    request's matcher with chosen tokens, through the engine's compiler.)"""
    tag = {
        "structures": [
            {
                "begin": "<f=go>",
                "schema": {"type": "object", "properties": {"n": {"enum": [7]}}, "required": ["n"]},
                "end": "</f>",
            }  # fmt: skip
        ],
        "triggers": ["<f="],
    }
    engine = make_engine(str(model_dir))
    grammar = engine.grammars.grammar(StructuredOutput(structural_tag=json.dumps(tag)))

    def ids(text):
        return engine.tokenizer.encode(text, add_special_tokens=False)

    free = ids("anything at all, even {x} < f")
    assert grammar.allowed_prefix(free) == len(free) and grammar.forced_tokens() == []
    head = ids("so: <f=")
    grammar.advance(head)
    forced = grammar.forced_tokens()
    assert engine.tokenizer.decode(forced) == "go>{"  # the begin, then the schema's start
    grammar.advance(head + forced)
    body = ids('"n": 7}</f>')
    assert grammar.allowed_prefix(body) == len(body)
    assert grammar.allowed_prefix(ids('"n": 8}')) < len(ids('"n": 8}'))
    assert grammar.allowed_prefix(ids('"m": 7}')) < len(ids('"m": 7}'))


# Forty alternatives that each match every string of a-l: llguidance's parser passes its
# limit of 2000 items a row at output token 15 (tests/engine/test_constraint_failures.py).
FAILING_GRAMMAR = (
    "start: s\ns: "
    + " | ".join(f"s{i}" for i in range(40))
    + "\n"
    + "".join(f"s{i}: s s | /[a-l]/\n" for i in range(40))
)


def test_a_failing_constraint_ends_only_its_stream_with_invalid_argument(spec_server, model_dir):
    """A grammar that drives the parser past its limit, at temperature 1 with fixed
    speculation (the issue's reproduction): its stream gets the tokens checked before
    the failure, then INVALID_ARGUMENT naming the constraint; a free stream beside it
    gets what the plain engine gives; no block stays in use and the server serves on
    (GenerateComplete and the gateway's protocol too)."""
    free = {"max_tokens": 48, "temperature": 0.0, "ignore_eos": True}
    expected = _plain(model_dir, None, **free)
    hostile = {
        "max_tokens": 40,
        "min_tokens": 40,
        "temperature": 1.0,
        "num_speculative_tokens": 4,
        "structured_output": {"grammar": FAILING_GRAMMAR},
    }
    with SpecserveClient(spec_server.target) as client:
        neighbour = client.generate(PROMPT, **free)
        first = next(iter(neighbour))  # running before the hostile request arrives
        got, error = [], None
        try:
            for delta in client.generate(PROMPT, **hostile):
                got += delta.token_ids
        except grpc.RpcError as exc:
            error = exc
        assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details().startswith("structured_output.grammar failed at output token ")
        # the parser's limit, or on a slow machine the step budget before it
        reasons = ("Current row has", "of CPU time in one engine step")
        assert any(r in error.details() for r in reasons) and "\n" not in error.details()
        assert len(got) <= 15
        rest = [t for d in neighbour for t in d.token_ids]
        assert first.token_ids + rest == expected
        with pytest.raises(grpc.RpcError) as info:
            client.generate_complete(PROMPT, **hostile)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert client.generate_complete(PROMPT, **free).token_ids == expected
        wait_no_blocks_in_use(client)

    sampling = vpb.SamplingParams(
        temperature=1.0, max_tokens=40, min_tokens=40, grammar=FAILING_GRAMMAR
    )
    request = vpb.GenerateRequest(sampling_params=sampling, stream=True)
    request.tokenized.input_ids.extend(PROMPT)
    with grpc.insecure_channel(spec_server.target) as channel, pytest.raises(grpc.RpcError) as info:
        list(vpb_grpc.VllmEngineStub(channel).Generate(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_output.grammar failed" in info.value.details()
