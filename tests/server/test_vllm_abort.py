"""VllmEngine Abort reaches a request from the moment its Generate is received: while
its text waits for the encoder, and between the admissions of its n choices. Every
choice ends "abort" and no KV block is left held."""

from __future__ import annotations

import copy
import threading
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from engine.client import SpecserveClient
from engine.core.llm_engine import LLMEngine
from tests.server.helpers import InProcessServer, wait_no_blocks_in_use, wait_until

LONG = dict(temperature=0.0, max_tokens=490, ignore_eos=True)  # runs for seconds
RESULT_WAIT_S = 10.0


class GatedTokenizer:
    """A real tokenizer whose ``encode`` waits while ``gate`` is clear (at most 60 s):
    the encoder lane it runs on is busy for as long as a test needs. Its deep copies
    (the encoder's lanes) share the gate and the record of what was encoded."""

    def __init__(self, inner: Any, gate: threading.Event, state: dict | None = None) -> None:
        self._inner = inner
        self.gate = gate
        self.state = state if state is not None else {"entered": threading.Event(), "texts": []}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def encode(self, text, *args, **kwargs):
        self.state["entered"].set()
        self.gate.wait(60)
        self.state["texts"].append(text)
        return self._inner.encode(text, *args, **kwargs)

    def __deepcopy__(self, memo) -> GatedTokenizer:
        return GatedTokenizer(copy.deepcopy(self._inner, memo), self.gate, self.state)


class Gated:
    def __init__(self, srv: InProcessServer, gate: threading.Event, tokenizer: GatedTokenizer):
        self.srv = srv
        self.gate = gate
        self.tokenizer = tokenizer

    @property
    def texts(self) -> list[str]:
        return self.tokenizer.state["texts"]

    def close_gate(self) -> None:
        self.tokenizer.state["entered"].clear()
        self.gate.clear()

    def wait_encoding(self) -> None:
        assert self.tokenizer.state["entered"].wait(10), "no prompt reached the encoder"


@pytest.fixture(scope="module")
def gated(engine_config):
    gate = threading.Event()
    gate.set()
    tokenizers: list[GatedTokenizer] = []

    def factory(config) -> LLMEngine:
        engine = LLMEngine(config)
        engine.tokenizer = GatedTokenizer(engine.tokenizer, gate)  # what the encoder copies
        tokenizers.append(engine.tokenizer)
        return engine

    with InProcessServer(engine_config, engine_factory=factory) as srv:
        yield Gated(srv, gate, tokenizers[0])
    gate.set()


@pytest.fixture()
def stub(gated: Gated):
    with grpc.insecure_channel(gated.srv.target) as channel:
        yield vpb_grpc.VllmEngineStub(channel)


def _request(prompt, request_id: str, stream: bool = False, **sampling) -> vpb.GenerateRequest:
    request = vpb.GenerateRequest(
        request_id=request_id, sampling_params=vpb.SamplingParams(**sampling), stream=stream
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.tokenized.input_ids.extend(prompt)
    return request


def _completes(responses) -> list[vpb.GenerateComplete]:
    return [r.complete for r in responses if r.WhichOneof("response") == "complete"]


def _chunks(responses) -> list[vpb.GenerateStreamChunk]:
    return [r.chunk for r in responses if r.WhichOneof("response") == "chunk"]


def _busy_encoder(gated: Gated, stub) -> Any:
    """A one-token request whose text holds the encoder's lane until the gate opens."""
    blocker = stub.Generate(_request("the encoder is busy", "blocker", max_tokens=1))
    gated.wait_encoding()
    return blocker


def _collect_within(call, timeout_s: float) -> list[vpb.GenerateResponse]:
    """Every response of ``call``, which must end within ``timeout_s``."""
    responses: list[vpb.GenerateResponse] = []
    reader = threading.Thread(target=lambda: responses.extend(call), daemon=True)
    reader.start()
    reader.join(timeout_s)
    assert not reader.is_alive(), f"the stream did not end within {timeout_s} s"
    return responses


def _assert_nothing_held(srv: InProcessServer) -> None:
    with SpecserveClient(srv.target) as client:
        wait_no_blocks_in_use(client)
    wait_until(lambda: srv.engine.num_in_flight == 0, 10, "every request to leave the engine")
    assert not {"INTERNAL", "UNKNOWN"} & set(srv.errors)


@pytest.mark.parametrize("n", [1, 3])
def test_abort_while_the_text_waits_for_the_encoder(gated: Gated, stub, n):
    """The encoder is busy with another prompt; our text waits in its queue when the
    Abort comes. Every choice ends "abort" at once, while the encoder is still busy,
    and our text is never encoded. (It used to be admitted only after encoding: the
    Abort found nothing and the request ran to "length".)"""
    srv = gated.srv
    text = f"Hello world, these {n} choices are aborted"
    gated.close_gate()
    blocker = target = None
    try:
        blocker = _busy_encoder(gated, stub)
        target = stub.Generate(_request(text, "abort-me", stream=True, n=n, **LONG))
        wait_until(lambda: srv.server.lifecycle.num_in_flight == 2, 10, "Generate received")
        stub.Abort(vpb.AbortRequest(request_ids=["abort-me"]), timeout=10)
        responses = _collect_within(target, RESULT_WAIT_S)
        assert not gated.gate.is_set()  # ended while the encoder was still busy
        assert not _chunks(responses)
        completes = _completes(responses)
        assert sorted(c.index for c in completes) == list(range(n))
        assert [c.finish_reason for c in completes] == ["abort"] * n
    finally:
        gated.gate.set()
        if target is not None:
            target.cancel()
    assert [c.finish_reason for c in _completes(blocker)] == ["length"]
    assert text not in gated.texts  # dropped from the encoder's queue
    _assert_nothing_held(srv)


def test_a_cancel_while_the_text_waits_for_the_encoder_gives_back_every_place(gated, stub):
    srv = gated.srv
    text = "Hello world, these choices are cancelled"
    gated.close_gate()
    try:
        blocker = _busy_encoder(gated, stub)
        target = stub.Generate(_request(text, "cancel-me", stream=True, n=3, **LONG))
        wait_until(lambda: srv.engine.num_in_flight == 4, 10, "every choice to be admitted")
        target.cancel()
        wait_until(lambda: srv.engine.num_in_flight == 1, 10, "the choices to leave")
    finally:
        gated.gate.set()
    assert [c.finish_reason for c in _completes(blocker)] == ["length"]
    assert text not in gated.texts
    _assert_nothing_held(srv)


def test_abort_between_the_admissions_of_n_choices(gated: Gated, stub, monkeypatch):
    """An Abort handled after the first choice started and before the others did
    (each choice is started in a task of its own) ends all of them. (It used to reach
    only the choices already admitted: the others ran to "length".)"""
    srv = gated.srv
    engine = srv.engine
    real_generate, real_abort = engine.generate, engine.abort
    num_started = 0

    async def generate(*args, **kwargs):
        nonlocal num_started
        num_started += 1
        if num_started == 2:  # choice 0 is in the engine, choices 1 and 2 are not
            await real_abort("abort-me")
        async for output in real_generate(*args, **kwargs):
            yield output

    monkeypatch.setattr(engine, "generate", generate)
    responses = list(stub.Generate(_request([5, 6, 7], "abort-me", n=3, **LONG), timeout=60))
    assert num_started == 3
    completes = _completes(responses)
    assert sorted(c.index for c in completes) == [0, 1, 2]
    assert [c.finish_reason for c in completes] == ["abort"] * 3
    _assert_nothing_held(srv)


def test_requests_after_an_abort_run_normally(gated: Gated, stub):
    """The label is free again once its requests ended: a new request with it runs."""
    request = _request([5, 6, 7], "abort-me", n=2, temperature=0.0, max_tokens=3, ignore_eos=True)
    completes = _completes(stub.Generate(request, timeout=60))
    assert [c.finish_reason for c in completes] == ["length"] * 2
    (text,) = _completes(
        stub.Generate(_request("Hello again", "abort-me", max_tokens=2), timeout=60)
    )
    assert text.finish_reason == "length" and text.prompt_tokens > 0
    _assert_nothing_held(gated.srv)
