"""The RPCs against an in-process server running the real engine on the tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading

import grpc
import pytest

from engine.client import AsyncSpecserveClient, SpecserveClient, build_request, retry_after_s
from engine.core.llm_engine import LLMEngine
from engine.loader import cpu_has_native_bf16
from engine.rpc import generation_pb2 as pb
from tests.server.helpers import InProcessServer, PacedEngine, wait_no_blocks_in_use, wait_until


def test_generate_streams_deltas_that_add_up_to_complete(client: SpecserveClient):
    kwargs = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    deltas = list(client.generate("Hello world", request_id="stream-1", **kwargs))
    assert all(d.request_id == "stream-1" for d in deltas)
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    last = deltas[-1]
    assert last.finish_reason == "length"
    token_ids = [t for d in deltas for t in d.token_ids]
    assert len(token_ids) == 12
    assert last.usage.completion_tokens == 12 and last.usage.prompt_tokens > 0
    complete = client.generate_complete("Hello world", **kwargs)
    assert complete.token_ids == token_ids
    assert complete.text == "".join(d.text for d in deltas)
    assert complete.finish_reason == "length" and complete.request_id.startswith("req-")


def test_tokenize_model_info_and_stats(client: SpecserveClient):
    info = client.model_info()
    assert info.vocab_size > 0 and info.max_model_len > 0 and info.block_size == 16
    assert info.num_kv_blocks == 512 and len(info.eos_token_ids) >= 1
    # the server's config says dtype auto: the model info says what auto chose
    expected = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert (info.device, info.dtype) == ("cpu", expected) and info.attn_backend
    ids = client.tokenize("Hello world")
    assert ids and all(0 <= t < info.vocab_size for t in ids)
    chat_ids = client.tokenize(messages=[{"role": "user", "content": "Hello"}])
    assert chat_ids
    deltas = list(client.generate(ids, max_tokens=2, temperature=0.0))
    assert deltas[-1].usage.prompt_tokens == len(ids)
    stats = client.server_stats()
    assert stats.target_pool.num_blocks > 0
    assert stats.target_pool.num_blocks_in_use + stats.target_pool.num_free_blocks == (
        stats.target_pool.num_blocks
    )


def test_chat_prompt_uses_template(client: SpecserveClient):
    messages = [{"role": "user", "content": "Hello"}]
    deltas = list(client.generate(messages=messages, max_tokens=3, temperature=0.0))
    assert deltas[-1].usage.prompt_tokens == len(client.tokenize(messages=messages))


def test_invalid_argument_names_field(client: SpecserveClient, server: InProcessServer):
    with pytest.raises(grpc.RpcError) as info:
        list(client.generate("x", max_tokens=0))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("sampling.max_tokens must be in [1, ")
    with pytest.raises(grpc.RpcError) as info:
        client.generate_complete("x", top_p=2.0)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.top_p" in info.value.details() and "(0, 1]" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        client.tokenize(messages=[{"role": "nobody", "content": "x"}])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "INVALID_ARGUMENT" in server.errors


def test_too_long_prompt_is_invalid_argument(client: SpecserveClient):
    max_model_len = client.model_info().max_model_len
    with pytest.raises(grpc.RpcError) as info:
        client.generate_complete("Hello world " * max_model_len, max_tokens=1)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_model_len" in info.value.details()


def test_text_that_cannot_fit_is_refused_before_tokenization(client: SpecserveClient, model_dir):
    from transformers import AutoTokenizer

    from engine.io.prompt_encoder import longest_token_chars

    longest = longest_token_chars(AutoTokenizer.from_pretrained(model_dir))
    max_chars = client.model_info().max_model_len * longest
    for request in (
        dict(prompt="x" * (max_chars + 1)),
        dict(messages=[{"role": "user", "content": "x" * (max_chars + 1)}]),
    ):
        with pytest.raises(grpc.RpcError) as info:
            client.generate_complete(max_tokens=1, **request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        field = "text" if "prompt" in request else "chat"
        assert info.value.details().startswith(
            f"{field} must have at most {max_chars} characters (max_model_len "
        )
    # Tokenize counts text longer than the context: a caller may want to know by how much.
    assert len(client.tokenize("x" * (max_chars + 1))) == max_chars + 1


def test_cancel_mid_stream_frees_blocks(client: SpecserveClient):
    stream = client.generate("Hello world", max_tokens=400, ignore_eos=True, temperature=0.0)
    received = 0
    for delta in stream:
        received += len(delta.token_ids)
        if received >= 3:
            stream.cancel()
            break
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    wait_no_blocks_in_use(client)


@pytest.fixture(scope="module")
def paced_client(engine_config):
    """A server whose steps take 10 ms or more: 490 tokens without speculation take 4.9 s
    or more, so a 0.2 s deadline passes mid-request on any CPU (the tiny model alone
    decoded 490 tokens inside 0.2 s on a Zen 5)."""
    factory = lambda config: PacedEngine(LLMEngine(config), 0.01)  # noqa: E731
    with (
        InProcessServer(engine_config, engine_factory=factory) as srv,
        SpecserveClient(srv.target) as client,
    ):
        yield client


def test_deadline_expiry_frees_blocks(paced_client: SpecserveClient):
    client = paced_client
    stream = client.generate(
        "Hello world", max_tokens=490, ignore_eos=True, num_speculative_tokens=0, timeout=0.2
    )
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_no_blocks_in_use(client)


def test_unary_deadline_frees_blocks(paced_client: SpecserveClient):
    client = paced_client
    with pytest.raises(grpc.RpcError) as info:
        client.generate_complete(
            "Hello", max_tokens=490, ignore_eos=True, num_speculative_tokens=0, timeout=0.2
        )
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_no_blocks_in_use(client)


def test_duplicate_request_id_in_flight_is_allowed(client: SpecserveClient):
    stream = client.generate("Hello", max_tokens=400, ignore_eos=True, request_id="dup")
    first = next(iter(stream))
    assert first.request_id == "dup"
    second = client.generate_complete("Hello", max_tokens=1, request_id="dup")
    assert second.request_id == "dup" and len(second.token_ids) == 1
    stream.cancel()
    wait_no_blocks_in_use(client)


def test_async_client(server: InProcessServer):
    async def run() -> tuple[list[int], list[int], str]:
        async with AsyncSpecserveClient(server.target) as client:
            streamed: list[int] = []
            async for delta in client.generate("Hello", max_tokens=5, temperature=0.0):
                streamed.extend(delta.token_ids)
            complete = await client.generate_complete("Hello", max_tokens=5, temperature=0.0)
            return streamed, complete.token_ids, await client.health()

    streamed, complete, health = asyncio.run(run())
    assert streamed == complete and len(streamed) == 5 and health == "SERVING"


def test_overload_is_resource_exhausted_with_retry_hint(engine_config):
    config = dataclasses.replace(engine_config, max_num_seqs=1, max_waiting_requests=1)
    with InProcessServer(config) as srv, SpecserveClient(srv.target) as client:
        long = dict(max_tokens=480, ignore_eos=True, temperature=0.0, num_speculative_tokens=0)
        running = client.generate("Hello", **long)
        next(iter(running))  # scheduled: holds the only running slot
        waiting = client.generate("Hello", **long)
        threading.Thread(target=_drain, args=(waiting,), daemon=True).start()
        wait_until(lambda: client.server_stats().num_waiting == 1, 10, "one waiting request")
        with pytest.raises(grpc.RpcError) as info:
            client.generate_complete("Hello", max_tokens=1)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert retry_after_s(info.value) > 0
        assert "RESOURCE_EXHAUSTED" in srv.errors
        running.cancel()
        waiting.cancel()
        wait_no_blocks_in_use(client)


def _drain(stream) -> None:
    with contextlib.suppress(grpc.RpcError):
        list(stream)


def test_raw_stub_unset_prompt(server: InProcessServer):
    from engine.rpc import generation_pb2_grpc as pb_grpc

    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.GenerateComplete(pb.GenerateRequest())
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("prompt must be set")
        ok = stub.GenerateComplete(build_request("Hi", max_tokens=1))
        assert len(ok.token_ids) == 1


def test_logprobs_stop_strings_and_seeded_sampling(client: SpecserveClient):
    deltas = list(client.generate("Hello", max_tokens=4, temperature=0.0, top_logprobs=2))
    logprobs = [lp for d in deltas for lp in d.logprobs]
    token_ids = [t for d in deltas for t in d.token_ids]
    assert [lp.token_id for lp in logprobs] == token_ids
    assert all(lp.logprob <= 0 and len(lp.top) == 2 for lp in logprobs)
    a = client.generate_complete("Hello", max_tokens=8, temperature=1.0, seed=123)
    b = client.generate_complete("Hello", max_tokens=8, temperature=1.0, seed=123)
    assert a.token_ids == b.token_ids
    stop_id = token_ids[1]
    stopped = client.generate_complete("Hello", max_tokens=4, temperature=0.0,
                                       stop_token_ids=[stop_id])  # fmt: skip
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    assert stopped.token_ids == token_ids[: token_ids.index(stop_id) + 1]
