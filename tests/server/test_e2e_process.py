"""End to end against `specserve serve` (`python -m engine serve`) in a process."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import urllib.request

import grpc
import pytest

from engine.client import AsyncSpecserveClient, SpecserveClient
from engine.io.sampling_params import SamplingParams
from tests.server.helpers import ServerProcess, wait_no_blocks_in_use, wait_until

PROMPTS = ["Hello world", "The capital of France is", "0123456789", "Speculative decoding"]


def offline_generate(engine_config, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    """Token ids from the offline API for the same requests."""
    try:
        from engine import LLM
    except ImportError:  # the offline API has not landed: drive LLMEngine directly
        return _engine_generate(engine_config, prompts, params)
    llm = LLM(model=engine_config.model, device="cpu", num_kv_blocks=engine_config.num_kv_blocks)
    return [list(out.token_ids) for out in llm.generate(prompts, params)]


def _engine_generate(engine_config, prompts, params) -> list[list[int]]:
    from engine.core.llm_engine import LLMEngine

    engine = LLMEngine(engine_config)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    token_ids: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for output in engine.step():
            token_ids[output.request_id].extend(output.token_ids)
    return [token_ids[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def process(model_dir):
    proc = ServerProcess(model_dir).start()
    yield proc
    proc.kill()


def test_health_not_serving_while_loading_then_serving(process: ServerProcess):
    # The port is watched with plain TCP connects first: a grpc channel refused before the
    # port is bound backs off for a second or more, longer than the tiny model's loading.
    host, port = process.target.rsplit(":", 1)
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "the server process never bound its port"
            time.sleep(0.005)
    seen: list[str] = []
    with SpecserveClient(process.target) as client:

        def serving() -> bool:
            try:
                status = client.health(timeout=1)
            except grpc.RpcError as exc:
                status = exc.code().name
            if not seen or seen[-1] != status:
                seen.append(status)
            return status == "SERVING"

        wait_until(serving, 120, "the server process to report SERVING")
    assert seen[0] == "NOT_SERVING" and seen[-1] == "SERVING", seen
    assert set(seen) <= {"UNAVAILABLE", "NOT_SERVING", "SERVING"}, seen


def test_streamed_tokens_equal_offline_generate(process: ServerProcess, engine_config):
    params = SamplingParams(max_tokens=24, temperature=0.0)
    expected = offline_generate(engine_config, PROMPTS, params)
    with SpecserveClient(process.target) as client:
        client.wait_serving(120)
        for prompt, want in zip(PROMPTS, expected, strict=True):
            deltas = list(client.generate(prompt, max_tokens=24, temperature=0.0))
            assert [t for d in deltas for t in d.token_ids] == want
            assert deltas[-1].usage.completion_tokens == len(want)


def test_64_concurrent_streams_complete_while_health_serving(process, engine_config):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(64)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = offline_generate(engine_config, prompts, params)

    async def run() -> tuple[list[list[int]], list[str]]:
        async with AsyncSpecserveClient(process.target) as client:
            await client.wait_serving(120)  # whichever test of the module runs first
            health: list[str] = []

            async def one(prompt: str) -> list[int]:
                ids: list[int] = []
                async for delta in client.generate(
                    prompt, max_tokens=10, temperature=0.0, ignore_eos=True
                ):
                    ids.extend(delta.token_ids)
                    if delta.finished:
                        assert delta.finish_reason == "length"
                return ids

            tasks = [asyncio.create_task(one(p)) for p in prompts]
            while not all(t.done() for t in tasks):
                health.append(await client.health())
                await asyncio.sleep(0.02)
            return [t.result() for t in tasks], health

    results, health = asyncio.run(run())
    assert results == expected
    assert health and set(health) == {"SERVING"}


def test_cancel_and_deadline_leave_no_blocks(process: ServerProcess):
    with SpecserveClient(process.target) as client:
        client.wait_serving(120)  # whichever test of the module runs first
        stream = client.generate("Hello world", max_tokens=400, ignore_eos=True)
        for _ in stream:
            stream.cancel()
            break
        # 490 steps cannot fit in 0.05 s: the scheduler alone takes about 0.2 ms a step
        # (`bench offline` prints it), and the stream's messages come on top. A real
        # process cannot be paced as tests/server/test_rpcs.py's deadline tests are.
        with pytest.raises(grpc.RpcError) as info:
            list(
                client.generate(
                    "Hello world",
                    max_tokens=490,
                    ignore_eos=True,
                    num_speculative_tokens=0,
                    timeout=0.05,
                )
            )
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_no_blocks_in_use(client)


def test_rpc_errors_reach_metrics_and_logs(process: ServerProcess):
    with SpecserveClient(process.target) as client:
        client.wait_serving(120)
        with pytest.raises(grpc.RpcError):
            client.generate_complete("Hi", max_tokens=0, request_id="bad-1")
        client.generate_complete("Hi", max_tokens=2, request_id="good-1")
    url = f"http://127.0.0.1:{process.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    assert 'specserve_grpc_errors_total{code="INVALID_ARGUMENT"} 1.0' in text


def test_sigterm_drains_in_flight_and_exits_zero(model_dir):
    proc = ServerProcess(
        model_dir, "--shutdown-grace", "60", "--speculative-method", "none"
    ).start()
    try:
        with SpecserveClient(proc.target) as client:
            client.wait_serving(120)
            results: list[tuple[int, str | None]] = []
            started = [threading.Event() for _ in range(4)]

            def consume(started: threading.Event) -> None:
                ids, reason = 0, None
                for delta in client.generate("Hello", max_tokens=480, ignore_eos=True):
                    ids += len(delta.token_ids)
                    reason = delta.finish_reason
                    started.set()
                results.append((ids, reason))

            threads = [threading.Thread(target=consume, args=(e,), daemon=True) for e in started]
            for t in threads:
                t.start()
            for event in started:  # every stream is running before the signal
                assert event.wait(30)
            proc.sigterm()
            wait_until(lambda: client.health() == "NOT_SERVING", 10, "health NOT_SERVING")
            with pytest.raises(grpc.RpcError) as info:
                client.generate_complete("Hi", max_tokens=1)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            for t in threads:
                t.join(60)
            assert results == [(480, "length")] * 4
        code, output = proc.wait(60)
    finally:
        proc.kill()
    assert code == 0, output
    assert "serving " in output and "stopped" in output, output
    assert "Traceback" not in output, output
