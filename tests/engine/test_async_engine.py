"""AsyncEngine: routing by internal key, abort by label, admission, prompt encoding off
both hot threads, published stats snapshots, and failure while a request is admitted."""

from __future__ import annotations

import asyncio
import copy
import math
import threading

import pytest

from engine.config import EngineConfig
from engine.core import async_engine
from engine.core.async_engine import AsyncEngine
from engine.core.llm_engine import LLMEngine
from engine.errors import EngineDeadError, EngineOverloadedError, EngineShutdownError
from engine.io.prompt_encoder import PromptEncoder
from engine.observability.metrics import EngineMetrics
from tests.engine.engine_helpers import greedy
from tests.engine.wrapped_engines import FailingEngine, GatedEngine, recording_engine
from tests.ops.scrape import parse, value


def _config(model_dir: str, **overrides) -> EngineConfig:
    kwargs = dict(model=model_dir, speculative_method="none", num_kv_blocks=64, device="cpu")
    kwargs.update(overrides)
    return EngineConfig(**kwargs)


async def _started(config: EngineConfig, factory=None) -> AsyncEngine:
    aengine = AsyncEngine(config, engine_factory=factory)
    aengine.start()
    await aengine.wait_ready(60)
    return aengine


async def _collect(outputs) -> list:
    return [output async for output in outputs]


def _token_ids(outputs) -> list[int]:
    return [t for output in outputs for t in output.token_ids]


def test_same_label_twice_runs_isolated_and_echoes_the_label(tiny_model_dir):
    async def main():
        aengine = await _started(_config(tiny_model_dir))
        alone_a = _token_ids(await _collect(aengine.generate([5, 6, 7], greedy(8))))
        alone_b = _token_ids(await _collect(aengine.generate([30, 31], greedy(5))))
        a, b = await asyncio.wait_for(
            asyncio.gather(
                _collect(aengine.generate([5, 6, 7], greedy(8), "same")),
                _collect(aengine.generate([30, 31], greedy(5), "same")),
            ),
            60,
        )
        assert _token_ids(a) == alone_a and _token_ids(b) == alone_b
        assert {o.client_request_id for o in a + b} == {"same"}
        assert {o.prompt_token_ids[0] for o in a} == {5}
        assert {o.prompt_token_ids[0] for o in b} == {30}
        assert a[0].request_id != b[0].request_id  # internal keys differ
        aengine.shutdown()

    asyncio.run(main())


def test_abort_by_label_ends_every_request_with_that_label(tiny_model_dir):
    gate = threading.Event()

    async def main():
        factory = lambda config: GatedEngine(LLMEngine(config), gate)  # noqa: E731
        aengine = await _started(_config(tiny_model_dir), factory)
        tasks = [
            asyncio.create_task(_collect(aengine.generate([5 + i, 6], greedy(50), label)))
            for i, label in enumerate(["L", "L", "M"])
        ]
        while aengine.num_in_flight < 3:
            await asyncio.sleep(0.01)
        assert await aengine.abort("L") == 2
        gate.set()
        aborted_1, aborted_2, kept = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        for aborted in (aborted_1, aborted_2):
            assert aborted[-1].finished and aborted[-1].finish_reason == "abort"
        assert kept[-1].finish_reason == "length" and len(_token_ids(kept)) == 50
        assert await aengine.abort("nobody") == 0
        aengine.shutdown()

    asyncio.run(main())


def test_admission_is_free_slots_plus_the_waiting_limit(tiny_model_dir):
    """4 running slots + 4 waiting: 40 simultaneous requests admit exactly 8; after
    they are cancelled the next request is admitted at once."""
    gate = threading.Event()

    async def main():
        config = _config(tiny_model_dir, max_num_seqs=4, max_waiting_requests=4)
        factory = lambda config: GatedEngine(LLMEngine(config), gate)  # noqa: E731
        aengine = await _started(config, factory)
        tasks = [
            asyncio.create_task(_collect(aengine.generate([5 + i, 6], greedy(20))))
            for i in range(40)
        ]
        for _ in range(1000):  # every request either refused or admitted (and held)
            if sum(t.done() for t in tasks) + aengine.num_in_flight == 40:
                break
            await asyncio.sleep(0.01)
        done = [t for t in tasks if t.done()]
        pending = [t for t in tasks if not t.done()]
        rejected = [t.exception() for t in done]
        assert all(isinstance(e, EngineOverloadedError) for e in rejected), rejected
        assert (len(rejected), len(pending)) == (32, 8)
        assert "4 requests waiting (limit 4)" in str(rejected[0])
        assert aengine.num_in_flight == 8
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        assert aengine.num_in_flight == 0
        next_request = asyncio.create_task(_collect(aengine.generate([9], greedy(3))))
        await asyncio.sleep(0)
        assert aengine.num_in_flight == 1  # admitted while the engine is still busy
        gate.set()
        assert len(_token_ids(await asyncio.wait_for(next_request, 60))) == 3
        aengine.shutdown()

    asyncio.run(main())


def test_tokenization_runs_once_per_request_off_the_engine_and_event_loop(tiny_model_dir):
    async def main():
        aengine = await _started(_config(tiny_model_dir), recording_engine)
        calls = aengine._engine.tokenizer.calls
        calls.clear()
        loop_thread = threading.current_thread().name
        text = await _collect(aengine.generate("Hello there", greedy(2)))
        chat = [{"role": "user", "content": "Hi"}]
        await _collect(aengine.generate(None, greedy(2), messages=chat))
        assert {thread for _, thread in calls}.isdisjoint({"engine-loop", loop_thread}), calls
        assert [name for name, _ in calls] == ["encode", "apply_chat_template", "encode"]
        assert await aengine.tokenize("Hello there") == text[0].prompt_token_ids
        threads = {thread for _, thread in calls}
        assert threads.isdisjoint({"engine-loop", loop_thread}), threads
        assert all(thread.startswith("tokenize-") for thread in threads), threads
        aengine.shutdown()

    asyncio.run(main())


def test_too_long_text_is_refused_before_the_engine_sees_it(tiny_model_dir):
    async def main():
        aengine = await _started(_config(tiny_model_dir))
        max_model_len = aengine.model_info["max_model_len"]
        with pytest.raises(ValueError, match=rf"max_model_len {max_model_len}\)"):
            await _collect(aengine.generate("x" * max_model_len, greedy(1)))
        with pytest.raises(ValueError, match="^chat: the templated prompt has"):
            chat = [{"role": "user", "content": "x" * max_model_len}]
            await _collect(aengine.generate(None, greedy(1), messages=chat))
        assert aengine.stats.num_steps == 0 and aengine.num_in_flight == 0
        aengine.shutdown()

    asyncio.run(main())


class _BlockingTokenizer:
    """Encodes one id per character once ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "<|long|>": 1}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.started.set()
        self.release.wait(30)
        return [0] * len(text)

    def __deepcopy__(self, memo) -> _BlockingTokenizer:
        return self  # one object: the test holds its events


def test_prompts_still_queued_at_shutdown_end_with_engine_shutdown_error():
    async def main():
        tokenizer = _BlockingTokenizer()
        encoder = PromptEncoder(tokenizer)
        assert encoder.max_token_chars == 8
        running = asyncio.create_task(encoder.encode("abc"))
        queued = asyncio.create_task(encoder.encode("de"))
        while not tokenizer.started.is_set():
            await asyncio.sleep(0.01)
        encoder.shutdown()
        tokenizer.release.set()
        assert await asyncio.wait_for(running, 10) == [0, 0, 0]
        with pytest.raises(EngineShutdownError):
            await asyncio.wait_for(queued, 10)
        with pytest.raises(EngineShutdownError):
            await encoder.encode("f")

    asyncio.run(main())


def test_published_stats_never_change_after_publication(tiny_model_dir):
    async def main():
        aengine = await _started(_config(tiny_model_dir))
        await _collect(aengine.generate([5, 6, 7], greedy(4)))
        published = aengine.stats
        frozen = copy.deepcopy(published)
        assert published.num_requests_finished["length"] == 1
        await _collect(aengine.generate([8, 9], greedy(6)))
        async for _ in aengine.generate([10, 11], greedy(50)):
            break  # aborted: published after the abort, outside any step
        while aengine.stats.num_requests_finished["abort"] == 0:
            await asyncio.sleep(0.01)
        assert published == frozen
        latest = aengine.stats
        assert latest is not published and latest.num_steps > published.num_steps
        assert latest.target_pool is not published.target_pool
        assert latest.num_requests_finished is not published.num_requests_finished
        aengine.shutdown()

    asyncio.run(main())


def test_a_request_admitted_while_the_engine_dies_is_ended(tiny_model_dir, monkeypatch):
    """The engine fails between _admit's checks and the stream's registration: the
    request must end with EngineDeadError, not wait forever."""
    fail = threading.Event()

    async def main():
        factory = lambda config: FailingEngine(LLMEngine(config), fail)  # noqa: E731
        aengine = await _started(_config(tiny_model_dir), factory)
        victim = asyncio.create_task(_collect(aengine.generate([5, 6], greedy(400))))
        while aengine.stats.num_steps == 0:
            await asyncio.sleep(0.01)
        real_stream = async_engine._RequestStream

        def stream_while_the_engine_dies(*args):
            fail.set()
            # Where admission is atomic with _fail_all, the engine thread waits for the
            # admission lock, so this join gives up; otherwise the engine is gone by now.
            aengine._thread.join(1.0)
            return real_stream(*args)

        monkeypatch.setattr(async_engine, "_RequestStream", stream_while_the_engine_dies)
        with pytest.raises(EngineDeadError, match="injected device fault"):
            await asyncio.wait_for(_collect(aengine.generate([7], greedy(2))), 10)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(victim, 10)
        aengine.shutdown()

    asyncio.run(main())


def test_metrics_gauges_stop_looking_live_after_the_engine_dies(tiny_model_dir):
    fail = threading.Event()

    async def main():
        metrics = EngineMetrics()
        factory = lambda config: FailingEngine(LLMEngine(config), fail)  # noqa: E731
        aengine = AsyncEngine(
            _config(tiny_model_dir), engine_factory=factory, step_observers=[metrics.observe_step]
        )
        aengine.failure_observers.append(metrics.on_engine_failed)
        aengine.start()
        await aengine.wait_ready(60)
        victim = aengine.generate([5, 6], greedy(400))
        await victim.__anext__()
        for _ in range(500):  # observers run just after the first delta is delivered
            samples = parse(metrics.render())
            if value(samples, "specserve_num_requests_running") == 1:
                break
            await asyncio.sleep(0.01)
        assert value(samples, "specserve_num_requests_running") == 1
        assert value(samples, "specserve_kv_cache_usage_perc", pool="target") > 0
        fail.set()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_collect(victim), 10)
        samples = parse(metrics.render())
        assert math.isnan(value(samples, "specserve_num_requests_running"))
        assert math.isnan(value(samples, "specserve_num_requests_waiting"))
        with pytest.raises(KeyError):
            value(samples, "specserve_kv_cache_usage_perc", pool="target")
        aengine.shutdown()

    asyncio.run(main())


def test_a_prompt_far_too_long_is_refused_from_a_prefix(tiny_model_dir):
    """Byte-level tiny tokenizer: one character is one token. A 20k-character prompt for
    511 allowed tokens is refused after encoding a prefix, never the whole text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    encoded: list[int] = []
    encode = tokenizer.encode

    def recording_encode(text, **kw):
        encoded.append(len(text))
        return encode(text, **kw)

    tokenizer.encode = recording_encode
    encoder = PromptEncoder(tokenizer)
    encoder._lanes = [(pool, tokenizer) for pool, _ in encoder._lanes]  # the recording one

    async def main():
        with pytest.raises(ValueError, match=r"^the prompt has more than \d+ tokens; .* 511 "):
            await encoder.encode("ab " * 7000, max_tokens=511)
        assert encoded and max(encoded) < 5000
        with pytest.raises(ValueError, match=r"^the prompt has 600 tokens; .*at most 511"):
            await encoder.encode("x" * 600, max_tokens=511)
        assert len(await encoder.encode("y" * 511, max_tokens=511)) == 511

    asyncio.run(main())
    encoder.shutdown()
