"""vllm.grpc.engine.VllmEngine (what the Shepherd Model Gateway calls) against an
in-process server running the real engine on the tiny model."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import math
import threading
import zipfile
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from engine.client import SpecserveClient
from engine.core.llm_engine import LLMEngine
from engine.server import vllm_request
from engine.server.app import ServerOptions
from engine.server.validation import ModelLimits
from tests.server.helpers import (
    InProcessServer,
    fastest_s,
    wait_no_blocks_in_use,
    wait_until,
)

PROMPT = list(range(3, 43))  # 40 token ids: two full KV blocks and a partial one
NEVER = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


@pytest.fixture()
def stub(server: InProcessServer):
    with grpc.insecure_channel(server.target) as channel:
        yield vpb_grpc.VllmEngineStub(channel)


def _request(prompt=PROMPT, stream=False, request_id="", **sampling) -> vpb.GenerateRequest:
    request = vpb.GenerateRequest(
        request_id=request_id,
        sampling_params=vpb.SamplingParams(**sampling),
        stream=stream,
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


GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = dict(temperature=0.0, max_tokens=490, ignore_eos=True)


def test_stream_chunks_are_deltas_and_equal_the_unstreamed_output(stub, client):
    streamed = list(stub.Generate(_request(stream=True, **GREEDY), timeout=60))
    chunks, (complete,) = _chunks(streamed), _completes(streamed)
    assert streamed[-1].WhichOneof("response") == "complete"
    token_ids = [t for c in chunks for t in c.token_ids]
    assert len(token_ids) == 12
    assert all(c.completion_tokens == len(c.token_ids) > 0 for c in chunks)  # the delta count
    assert all(c.prompt_tokens == len(PROMPT) and c.index == 0 for c in chunks)
    assert complete.finish_reason == "length" and complete.prompt_tokens == len(PROMPT)
    # As vLLM's servicer: the Complete of a stream repeats its last delta only.
    assert list(complete.output_ids) == list(chunks[-1].token_ids)
    assert complete.completion_tokens == len(chunks[-1].token_ids)
    (whole,) = _completes(stub.Generate(_request(**GREEDY), timeout=60))
    assert list(whole.output_ids) == token_ids and whole.completion_tokens == 12
    assert whole.cached_tokens == 32  # the two full blocks the stream left in the cache
    # The same greedy tokens as specserve.v1 gives for the same prompt.
    assert client.generate_complete(PROMPT, **GREEDY).token_ids == token_ids


def test_text_input_goes_through_the_engines_encoder(stub, client):
    (complete,) = _completes(stub.Generate(_request("Hello world", **GREEDY), timeout=60))
    assert complete.prompt_tokens == len(client.tokenize("Hello world"))


def test_unset_max_tokens_is_the_rest_of_the_context(stub, client):
    max_model_len = client.model_info().max_model_len
    prompt = [5] * (max_model_len - 7)
    (complete,) = _completes(
        stub.Generate(_request(prompt, temperature=0.0, ignore_eos=True), timeout=60)
    )
    assert complete.completion_tokens == 7 and complete.finish_reason == "length"


def test_n_choices_differ_are_seeded_and_stream_with_their_index(stub):
    sampled = dict(temperature=1.0, max_tokens=8, ignore_eos=True, seed=-7)
    completes = _completes(stub.Generate(_request(n=3, **sampled), timeout=60))
    assert sorted(c.index for c in completes) == [0, 1, 2]
    outputs = {c.index: list(c.output_ids) for c in completes}
    assert len({tuple(o) for o in outputs.values()}) > 1  # a seed of its own per choice
    again = _completes(stub.Generate(_request(n=3, **sampled), timeout=60))
    assert {c.index: list(c.output_ids) for c in again} == outputs
    (single,) = _completes(stub.Generate(_request(n=1, **sampled), timeout=60))
    assert list(single.output_ids) == outputs[0]  # choice 0 is the request with n = 1
    streamed = list(stub.Generate(_request(n=2, stream=True, **sampled), timeout=60))
    for index in (0, 1):
        tokens = [t for c in _chunks(streamed) if c.index == index for t in c.token_ids]
        assert tokens == outputs[index]
        assert [c.index for c in _completes(streamed)].count(index) == 1


def test_logprobs_and_stop_token(stub):
    responses = list(stub.Generate(_request(stream=True, logprobs=2, **GREEDY), timeout=60))
    chunks = _chunks(responses)
    for chunk in chunks:
        assert list(chunk.output_logprobs.token_ids) == list(chunk.token_ids)
        assert all(lp <= 0 for lp in chunk.output_logprobs.token_logprobs)
        assert all(len(top.token_ids) == 2 for top in chunk.output_logprobs.top_logprobs)
    token_ids = [t for c in chunks for t in c.token_ids]
    stop_id = token_ids[2]
    (stopped,) = _completes(stub.Generate(_request(stop_token_ids=[stop_id], **GREEDY), timeout=60))
    assert stopped.finish_reason == "stop" and stopped.matched_token_id == stop_id
    assert list(stopped.output_ids) == token_ids[: token_ids.index(stop_id) + 1]
    assert len(stopped.output_logprobs.token_ids) == 0  # none asked for


def test_logit_processing_fields_reach_the_engine(stub):
    (biased,) = _completes(stub.Generate(_request(logit_bias={7: 100.0}, **GREEDY), timeout=60))
    assert list(biased.output_ids) == [7] * 12
    (plain,) = _completes(stub.Generate(_request(**GREEDY), timeout=60))
    first = plain.output_ids[0]
    (held,) = _completes(
        stub.Generate(_request(min_tokens=3, stop_token_ids=[first], **GREEDY), timeout=60)
    )
    assert len(held.output_ids) >= 3  # the stop token is masked until 3 tokens are out
    for truncate, expected in ((10, 10), (-1, len(PROMPT))):
        (cut,) = _completes(
            stub.Generate(_request(truncate_prompt_tokens=truncate, **GREEDY), timeout=60)
        )
        assert cut.prompt_tokens == expected
    (penalized,) = _completes(
        stub.Generate(_request(repetition_penalty=2.0, frequency_penalty=2.0, **GREEDY))
    )
    assert list(penalized.output_ids) != list(plain.output_ids)


def _sampling(**fields):
    def mutate(request: vpb.GenerateRequest) -> None:
        request.sampling_params.MergeFrom(vpb.SamplingParams(**fields))

    return mutate


def _set(**fields):
    def mutate(request: vpb.GenerateRequest) -> None:
        request.MergeFrom(vpb.GenerateRequest(**fields))

    return mutate


def _input_ids(ids):
    def mutate(request: vpb.GenerateRequest) -> None:
        request.tokenized.ClearField("input_ids")
        request.tokenized.input_ids.extend(ids)

    return mutate


REFUSALS = [
    (_sampling(regex="(a"), "structured_output.regex: "),  # the compiler's message
    (_sampling(json_schema="[1]"), "sampling_params.json_schema must be a JSON object"),
    (_sampling(json_schema='{"type": "objekt"}'), "structured_output.json_schema: Invalid"),
    (_sampling(choice=vpb.ChoiceConstraint()), "sampling_params.choice must hold 1 to 256"),
    (_sampling(grammar='start: "a'), "structured_output.grammar: "),
    (_sampling(structural_tag='{"structures": []}'), "structured_output.structural_tag must"),
    (_sampling(prompt_logprobs=1), "sampling_params.prompt_logprobs is not supported"),
    (_sampling(logprobs=-1), "sampling_params.logprobs must be in [0, 20] (-1"),
    (_sampling(logprobs=21), "sampling_params.logprobs must be in [0, 20]"),
    (_sampling(n=65), "sampling_params.n must be in [1, "),
    (_sampling(max_tokens=0), "sampling_params.max_tokens must be in [1, 512]"),
    (_sampling(temperature=-1), "sampling_params.temperature must be a finite number"),
    (_sampling(temperature=math.nan), "sampling_params.temperature must be a finite number"),
    (_sampling(top_p=2.0), "sampling_params.top_p must be in (0, 1]"),
    (_sampling(min_p=-0.5), "sampling_params.min_p must be in [0, 1]"),
    (_sampling(frequency_penalty=5), "sampling_params.frequency_penalty must be in [-2, 2]"),
    (_sampling(min_tokens=9, max_tokens=4), "sampling_params.min_tokens must be"),
    (_sampling(logit_bias={999: 1.0}), "sampling_params.logit_bias token ids must be in"),
    (_sampling(logit_bias={5: 1000.0}), "sampling_params.logit_bias[5] must be in"),
    (_sampling(truncate_prompt_tokens=0), "sampling_params.truncate_prompt_tokens must be"),
    (_sampling(stop=["x"] * 17), "sampling_params.stop must have at most 16"),
    (_sampling(stop_token_ids=[999]), "sampling_params.stop_token_ids must be in [0, 258]"),
    (_set(mm_inputs=vpb.MultimodalInputs(mm_hashes=["h"])), "mm_inputs: multimodal input"),
    (_set(media_refs=vpb.MediaRefs()), "media_refs: multimodal input is not supported"),
    (_set(kv_transfer_params=vpb.KvTransferParams()), "kv_transfer_params: KV transfer"),
    (_set(kv_transfer_params_json="{}"), "kv_transfer_params_json: KV transfer"),
    (_set(data_parallel_rank=1), "data_parallel_rank must be 0 or unset"),
    (_set(request_id="has space"), "request_id must be 1 to 128 printable ASCII"),
    (_input_ids([]), "tokenized.input_ids must have at least one id"),
    (_input_ids([3, 999]), "tokenized.input_ids must be in [0, 258]"),
    (_input_ids([3] * 512), "tokenized.input_ids must have at most 511 ids"),
    (_set(text=""), "text must be a non-empty string"),
    (_set(text="x" * 200_000), "text must have at most"),
]


@pytest.mark.parametrize(("mutate", "details"), REFUSALS)
def test_refusals_name_the_field(stub, server: InProcessServer, mutate, details):
    request = _request([3, 4])
    mutate(request)
    for stream in (False, True):
        request.stream = stream
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert info.value.details().startswith(details), info.value.details()
        assert "\n" not in info.value.details()
    assert not set(server.errors) & {code.name for code in NEVER}


def test_input_must_be_set(stub):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(vpb.GenerateRequest(), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "input must be set: one of tokenized, text"


def test_fields_the_engine_lacks_are_refused_by_name(monkeypatch):
    limits = ModelLimits(vocab_size=259, max_model_len=512)
    request = _request(min_tokens=2, max_tokens=4)
    assert vllm_request.to_vllm_request(request, limits, 8).kwargs["min_tokens"] == 2
    monkeypatch.setattr(
        vllm_request, "_ENGINE_FIELDS", vllm_request._ENGINE_FIELDS - {"min_tokens"}
    )
    with pytest.raises(ValueError, match=r"^sampling_params.min_tokens is not supported"):
        vllm_request.to_vllm_request(request, limits, 8)
    # Left at its default, the missing field is not an error.
    assert "min_tokens" not in vllm_request.to_vllm_request(_request(), limits, 8).kwargs


def test_truncation_reads_only_the_input_ids_it_keeps():
    """The last n ids, range-checked, never more than the context holds; the rest is
    never read (15M ids held the event loop over a second when each one was read)."""
    limits = ModelLimits(vocab_size=259, max_model_len=512)

    def prompt_ids(ids, **sampling) -> list[int] | None:
        request = _request(ids, **sampling)
        return vllm_request.to_vllm_request(request, limits, 8).prompt_ids

    huge = _request([5], truncate_prompt_tokens=16)
    huge.tokenized.input_ids.extend(itertools.repeat(5, 5_000_000))
    huge.tokenized.input_ids.extend(range(100, 116))
    kept = vllm_request.to_vllm_request(huge, limits, 8).prompt_ids
    assert kept == list(range(100, 116))
    # Against reading every id once, timed here and now: reading and checking each one
    # took 0.4 s; reading only the kept ones, well under a millisecond.
    kept_s = fastest_s(lambda: vllm_request.to_vllm_request(huge, limits, 8))
    assert kept_s < fastest_s(lambda: list(huge.tokenized.input_ids)) / 4
    # Ids that truncation drops are never read, so never refused.
    assert prompt_ids([999] * 600 + [7, 8, 9], truncate_prompt_tokens=3) == [7, 8, 9]
    ids = [i % 250 for i in range(600)]
    assert prompt_ids(ids, truncate_prompt_tokens=-1) == ids[-511:]  # the whole context
    with pytest.raises(ValueError, match=r"^tokenized.input_ids must be in \[0, 258\]"):
        prompt_ids([1] * 600 + [7, 300, 9], truncate_prompt_tokens=3)
    with pytest.raises(ValueError) as info:
        prompt_ids([1] * 600, truncate_prompt_tokens=520)
    assert str(info.value) == (
        "tokenized.input_ids must have at most 511 ids (max_model_len - 1) after "
        "sampling_params.truncate_prompt_tokens, got 520"
    )


class SteppedEngine:
    """The real engine, whose every step() takes one permit from ``permits`` (waiting at
    most 60 s): a test decides how far requests get, with no timing involved."""

    def __init__(self, inner: LLMEngine, permits: threading.Semaphore) -> None:
        self._inner = inner
        self._permits = permits

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def step(self):
        self._permits.acquire(timeout=60)
        return self._inner.step()


@dataclasses.dataclass
class Stepped:
    srv: InProcessServer
    stub: vpb_grpc.VllmEngineStub
    client: SpecserveClient
    permits: threading.Semaphore

    def hold(self) -> None:
        while self.permits.acquire(blocking=False):
            pass

    def step(self, num_steps: int = 1) -> None:
        self.permits.release(num_steps)

    def blocks_in_use(self) -> int:
        return self.client.server_stats(timeout=10).target_pool.num_blocks_in_use

    def free_run(self) -> None:
        """Let everything finish and check nothing holds KV blocks."""
        self.step(10_000)
        wait_no_blocks_in_use(self.client)
        self.hold()


@pytest.fixture(scope="module")
def stepped(engine_config):
    """Admission: 2 running + 1 waiting. Steps only run when a test releases them."""
    permits = threading.Semaphore(0)
    config = dataclasses.replace(engine_config, max_num_seqs=2, max_waiting_requests=1)
    factory = lambda config: SteppedEngine(LLMEngine(config), permits)  # noqa: E731
    with (
        InProcessServer(config, engine_factory=factory) as srv,
        grpc.insecure_channel(srv.target) as channel,
        SpecserveClient(srv.target) as client,
    ):
        yield Stepped(srv, vpb_grpc.VllmEngineStub(channel), client, permits)


def _first_chunk(stepped: Stepped, stream) -> vpb.GenerateStreamChunk:
    stepped.step()  # the prefill, which samples the first token; the next step waits
    response = next(stream)
    assert response.WhichOneof("response") == "chunk"
    return response.chunk


def test_abort_mid_stream_ends_it_and_frees_blocks(stepped: Stepped):
    stepped.hold()
    stream = stepped.stub.Generate(_request(request_id="to-abort", stream=True, **LONG))
    _first_chunk(stepped, stream)
    assert stepped.blocks_in_use() > 0
    stepped.stub.Abort(vpb.AbortRequest(request_ids=["to-abort", "unknown-id"]), timeout=10)
    stepped.step()  # the loop applies the abort after the step it is in
    assert _completes(list(stream))[-1].finish_reason == "abort"  # the stream ends OK
    stepped.free_run()


def test_cancel_and_deadline_free_blocks(stepped: Stepped):
    stepped.hold()
    stream = stepped.stub.Generate(_request(stream=True, n=2, **LONG))
    _first_chunk(stepped, stream)
    # Before the cancel: the loop may apply it between the prefill step and the next
    # one (it drains commands there), so after it the blocks may already be free.
    assert stepped.blocks_in_use() > 0
    stream.cancel()
    stepped.free_run()  # and every block comes back
    for stream_flag in (True, False):
        call = stepped.stub.Generate(_request([5, 6], stream=stream_flag, **LONG), timeout=1.0)
        stepped.step()  # the prefill: blocks are held when the deadline passes
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert stepped.blocks_in_use() > 0
        stepped.free_run()
    assert {"CANCELLED", "DEADLINE_EXCEEDED"} <= set(stepped.srv.errors)


def test_n_choices_are_admitted_all_or_none(stepped: Stepped):
    stepped.hold()
    stub = stepped.stub
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(_request(n=4, stream=True, **LONG), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # more than may ever run
    assert info.value.details().startswith("sampling_params.n must be in [1, 3]")
    running = stub.Generate(_request(stream=True, **LONG))
    _first_chunk(stepped, running)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(_request(n=3, stream=True, **LONG), timeout=30))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(info.value.trailing_metadata())["retry-after-ms"]
    running.cancel()
    stepped.free_run()
    stepped.step(10_000)  # with room again, all three run
    completes = _completes(stub.Generate(_request(n=3, **GREEDY), timeout=60))
    assert [c.finish_reason for c in completes] == ["length"] * 3
    stepped.free_run()


def test_model_server_info_loads_and_health(stub, client, model_dir):
    info = stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=10)
    specserve_info = client.model_info()
    assert info.is_generation and not info.supports_vision
    assert info.max_context_length == specserve_info.max_model_len
    assert info.max_req_input_len == specserve_info.max_model_len - 1
    assert info.vocab_size == specserve_info.vocab_size
    assert list(info.eos_token_ids) == list(specserve_info.eos_token_ids)
    assert info.model_type == "llama" and list(info.architectures) == ["LlamaForCausalLM"]
    assert info.tokenizer_path == str(model_dir)
    server_info = stub.GetServerInfo(vpb.GetServerInfoRequest(), timeout=10)
    assert server_info.server_type == "vllm-grpc"
    assert server_info.block_size == 16 and server_info.data_parallel_size == 1
    assert server_info.max_num_seqs == specserve_info.max_num_seqs
    assert server_info.model_dtype == f"torch.{specserve_info.dtype}"
    loads = stub.GetLoads(vpb.GetLoadsRequest(), timeout=10)
    (load,) = loads.loads
    assert loads.dp_rank_count == 1 and load.max_running_requests == specserve_info.max_num_seqs
    assert load.max_total_num_tokens == specserve_info.num_kv_blocks * 16
    assert 0 <= load.token_usage <= 1 and 0 <= load.cache_hit_rate <= 1
    assert stub.HealthCheck(vpb.HealthCheckRequest(), timeout=10).healthy


def test_health_service_lists_the_vllm_service(server: InProcessServer):
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="vllm.grpc.engine.VllmEngine")
        status = health.Check(request, timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_tokenizer_bundle_is_a_zip_with_its_digest(stub, model_dir):
    chunks = list(stub.GetTokenizer(cpb.GetTokenizerRequest(), timeout=60))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(c.sha256 == "" for c in chunks[:-1])
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(names)
    again = list(stub.GetTokenizer(cpb.GetTokenizerRequest(), timeout=60))
    assert again[-1].sha256 == chunks[-1].sha256  # built once


def test_flush_cache_and_unimplemented_rpcs(stub, client):
    list(stub.Generate(_request(**GREEDY), timeout=60))
    flushed = stub.FlushCache(cpb.FlushCacheRequest(), timeout=10)
    assert flushed.success, flushed.message
    (again,) = _completes(stub.Generate(_request(**GREEDY), timeout=60))
    assert again.cached_tokens == 0  # nothing left to hit
    with pytest.raises(grpc.RpcError) as info:
        stub.FlushCache(cpb.FlushCacheRequest(timeout_s=-1), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("timeout_s must be")
    for call, request in (
        (stub.Embed, vpb.EmbedRequest()),
        (stub.StartProfile, cpb.StartProfileRequest()),
        (stub.StopProfile, cpb.StopProfileRequest()),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "not supported" in info.value.details()


def test_api_key_is_required_and_health_is_exempt(engine_config):
    key = "vllm-key"
    options = ServerOptions(host="127.0.0.1", port=0, api_key=key)
    with InProcessServer(engine_config, options) as srv, grpc.insecure_channel(srv.target) as ch:
        stub = vpb_grpc.VllmEngineStub(ch)
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            for call in (
                lambda md: list(stub.Generate(_request(**GREEDY), metadata=md, timeout=10)),
                lambda md: stub.GetModelInfo(vpb.GetModelInfoRequest(), metadata=md),
                lambda md: next(
                    stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), metadata=md)
                ),
            ):
                with pytest.raises(grpc.RpcError) as info:
                    call(metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = (("authorization", f"Bearer {key}"),)
        assert _completes(stub.Generate(_request(**GREEDY), metadata=good, timeout=60))
        health = health_pb2_grpc.HealthStub(ch)
        request = health_pb2.HealthCheckRequest(service="vllm.grpc.engine.VllmEngine")
        assert health.Check(request, timeout=10).status == health_pb2.HealthCheckResponse.SERVING


def test_drain_refuses_generate_ends_subscriptions_and_health_says_so(engine_config):
    srv = InProcessServer(engine_config).start()
    stopping = threading.Thread(target=srv.stop, kwargs={"grace_s": 30})
    try:
        with grpc.insecure_channel(srv.target) as channel:
            stub = vpb_grpc.VllmEngineStub(channel)
            subscription = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), timeout=60)
            next(subscription)
            running = stub.Generate(_request(stream=True, **LONG), timeout=60)
            next(running)
            stopping.start()
            wait_until(lambda: srv.server.lifecycle.draining, 10, "the server to drain")
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(_request(**GREEDY), timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            health = stub.HealthCheck(vpb.HealthCheckRequest(), timeout=10)
            assert not health.healthy and health.message == "shutting down"
            # The running stream finishes within the grace; the subscription ends OK.
            assert _completes(list(running))[-1].finish_reason == "length"
            list(subscription)
            stopping.join(60)
            assert not stopping.is_alive()
    finally:
        if not stopping.is_alive() and srv._thread.is_alive():
            srv.stop()
