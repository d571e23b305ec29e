"""SpecserveClient and AsyncSpecserveClient share one request/response layer: the same
calls give the same results, errors and timeouts."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from engine.client import AsyncSpecserveClient, SpecserveClient
from engine.io.outputs import TokenLogprob
from tests.server.helpers import free_port

CHAT = [{"role": "user", "content": "Hi there"}]
REQUESTS = [
    dict(prompt="Hello world", max_tokens=8, temperature=0.0, ignore_eos=True),
    dict(messages=CHAT, max_tokens=6, temperature=0.0, top_logprobs=2),
    dict(prompt=[5, 40, 77, 120], max_tokens=6, temperature=0.0, stop=["a"], top_k=3),
    dict(prompt="Hello", max_tokens=6, temperature=0.9, seed=7, num_speculative_tokens=0),
]


def _comparable(result, tolerant: bool = False):
    """Drop what legitimately differs between two runs: the server's request id, timings,
    prefix-cache hits and the speculation counts (k adapts to measured step times).
    ``tolerant``: logprobs compare within float round-off (a prefix-cache hit or a
    verification pass computes the same logits in another order)."""
    usage = result.usage and dataclasses.replace(
        result.usage,
        time_to_first_token_s=0.0,
        cached_prompt_tokens=0,
        draft_tokens=0,
        accepted_draft_tokens=0,
    )
    logprobs = [_approx(e) for e in result.logprobs] if tolerant else result.logprobs
    return dataclasses.replace(result, request_id="", usage=usage, logprobs=logprobs)


def _approx(entry: TokenLogprob) -> TokenLogprob:
    top = [(token_id, pytest.approx(logprob, abs=1e-4)) for token_id, logprob in entry.top]
    return TokenLogprob(entry.token_id, pytest.approx(entry.logprob, abs=1e-4), top)


def _error(exc: BaseException) -> tuple:
    if isinstance(exc, grpc.RpcError):
        return ("rpc", exc.code(), exc.details())
    return (type(exc).__name__, str(exc))


def _sync_results(target: str) -> list:
    results = []
    with SpecserveClient(target) as client:
        client.wait_serving(timeout=30)
        for kwargs in REQUESTS:
            results.append([_comparable(d, True) for d in client.generate(**kwargs)])
            results.append(_comparable(client.generate_complete(**kwargs), True))
        results.append(client.tokenize("Hello world"))
        results.append(client.tokenize(messages=CHAT))
        results.append(client.model_info())
        results.append(client.health())
        for call in (
            lambda: client.generate_complete("x", max_tokens=0),
            lambda: list(client.generate("x", temperature=-1.0)),
            lambda: client.health(service="no.such.Service"),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call()
            results.append(_error(info.value))
    return results


async def _async_results(target: str) -> list:
    results = []
    async with AsyncSpecserveClient(target) as client:
        await client.wait_serving(timeout=30)
        for kwargs in REQUESTS:
            results.append([_comparable(d) async for d in client.generate(**kwargs)])
            results.append(_comparable(await client.generate_complete(**kwargs)))
        results.append(await client.tokenize("Hello world"))
        results.append(await client.tokenize(messages=CHAT))
        results.append(await client.model_info())
        results.append(await client.health())

        async def stream():
            return [d async for d in client.generate("x", temperature=-1.0)]

        for call in (
            lambda: client.generate_complete("x", max_tokens=0),
            stream,
            lambda: client.health(service="no.such.Service"),
        ):
            with pytest.raises(grpc.RpcError) as info:
                await call()
            results.append(_error(info.value))
    return results


def test_sync_and_async_clients_give_identical_results(server):
    sync = _sync_results(server.target)
    assert sync == asyncio.run(_async_results(server.target))
    assert sum(len(deltas) for deltas in sync[0:8:2]) >= 4  # the streams really streamed
    assert sync[-3][1] == grpc.StatusCode.INVALID_ARGUMENT


def test_wait_serving_times_out_alike_naming_the_last_answer():
    target = f"127.0.0.1:{free_port()}"
    with SpecserveClient(target) as client, pytest.raises(TimeoutError) as sync_info:
        client.wait_serving(timeout=0.3)

    async def wait():
        async with AsyncSpecserveClient(target) as client:
            await client.wait_serving(timeout=0.3)

    with pytest.raises(TimeoutError) as async_info:
        asyncio.run(wait())
    assert str(async_info.value) == str(sync_info.value)
    assert str(sync_info.value) == (
        f"server {target} not SERVING after 0s (last health answer: UNAVAILABLE)"
    )
