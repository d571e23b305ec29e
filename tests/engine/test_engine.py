"""The engine loop: continuous batching is invisible in the outputs."""

from __future__ import annotations

import pytest
import torch

from engine.io.sampling_params import SamplingParams
from tests.engine.engine_helpers import (
    assert_all_blocks_released,
    greedy,
    hf_greedy,
    make_engine,
    prompts_of_lengths,
    run_to_completion,
)

LENGTHS = [1, 15, 16, 17, 33, 50]


def test_staggered_arrivals_match_solo_greedy_and_transformers(tiny_model_dir):
    prompts = prompts_of_lengths(LENGTHS)
    engine = make_engine(tiny_model_dir)
    arrivals = {2 * i: [(f"r{i}", p, greedy(12))] for i, p in enumerate(prompts)}
    results = run_to_completion(engine, arrivals)
    for i, prompt in enumerate(prompts):
        assert results[f"r{i}"]["token_ids"] == hf_greedy(tiny_model_dir, prompt, 12)
        assert results[f"r{i}"]["finish_reason"] == "length"
    assert_all_blocks_released(engine)


def test_chunked_prefill_equals_unchunked(tiny_model_dir):
    prompts = prompts_of_lengths([70, 45, 5], seed=1)
    outs = {}
    for budget in (16, 2048):
        engine = make_engine(tiny_model_dir, max_num_batched_tokens=budget)
        arrivals = {0: [(f"r{i}", p, greedy(10)) for i, p in enumerate(prompts)]}
        outs[budget] = run_to_completion(engine, arrivals)
        assert_all_blocks_released(engine)
    for i in range(len(prompts)):
        assert outs[16][f"r{i}"]["token_ids"] == outs[2048][f"r{i}"]["token_ids"]


def test_preemption_under_a_tiny_pool_keeps_outputs_identical(tiny_model_dir):
    prompts = prompts_of_lengths([20, 30, 10, 25, 18, 40], seed=2)
    arrivals = {0: [(f"r{i}", p, greedy(24)) for i, p in enumerate(prompts)]}
    roomy = run_to_completion(make_engine(tiny_model_dir), arrivals)
    engine = make_engine(tiny_model_dir, num_kv_blocks=9)  # 128 slots for ~300 tokens
    tight = run_to_completion(engine, {0: list(arrivals[0])})
    assert engine.scheduler.num_preemptions > 0
    for request_id, result in roomy.items():
        assert tight[request_id]["token_ids"] == result["token_ids"]
    assert_all_blocks_released(engine)


def test_prefix_cache_hits_skip_prefill_and_keep_outputs(tiny_model_dir):
    shared = prompts_of_lengths([40], seed=3)[0]
    engine = make_engine(tiny_model_dir)
    first = run_to_completion(engine, {0: [("a", shared + [5], greedy(8))]})
    second = run_to_completion(engine, {0: [("b", shared + [5], greedy(8))]})
    assert second["b"]["token_ids"] == first["a"]["token_ids"]
    assert second["b"]["metrics"].num_cached_prompt_tokens == 32
    assert_all_blocks_released(engine)


def test_abort_mid_prefill_and_mid_decode_frees_everything(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=16)
    engine.add_request("decode", [5, 6, 7], greedy(100))
    engine.step()
    engine.add_request("prefill", list(range(3, 90)), greedy(5))
    engine.step()
    assert engine.scheduler.requests["prefill"].num_computed_tokens < 87
    out = engine.abort_request("prefill")
    assert out.finished and out.finish_reason == "abort"
    engine.step()
    assert engine.abort_request("decode").finish_reason == "abort"
    assert engine.abort_request("decode") is None  # twice is harmless
    assert_all_blocks_released(engine)


def _stop_string_across_two_tokens(tokenizer, token_ids):
    """A substring of the decoded text made of the tail of one token's text and the head
    of the next one's, occurring nowhere earlier."""
    ends = [
        len(tokenizer.decode(token_ids[:k], skip_special_tokens=True))
        for k in range(len(token_ids) + 1)
    ]
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    for j in range(1, len(token_ids) - 1):
        a, b, c = ends[j], ends[j + 1], ends[j + 2]
        start, end = a + (b - a) // 2, b + (c - b + 1) // 2
        stop = text[start:end]
        clean = b > a and c > b and "\ufffd" not in text[a:c] and stop.strip()
        if clean and text.find(stop) == start:
            return stop
    return None


def test_stop_string_spanning_two_tokens(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    for seed in range(4, 40):
        prompt = prompts_of_lengths([8], seed=seed)[0]
        free = run_to_completion(engine, {0: [("free", prompt, greedy(16))]})["free"]
        stop = _stop_string_across_two_tokens(engine.tokenizer, free["token_ids"])
        if stop is not None:
            break
    assert stop is not None, "no prompt produced two printable tokens in a row"
    stopped = run_to_completion(engine, {0: [("s", prompt, greedy(16, stop=[stop]))]})["s"]
    assert stopped["finish_reason"] == "stop"
    assert stop not in stopped["text"]
    assert free["text"].startswith(stopped["text"])
    assert free["text"][len(stopped["text"]) :].startswith(stop)
    assert_all_blocks_released(engine)


def test_stop_token_and_eos(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    prompt = prompts_of_lengths([6], seed=5)[0]
    free = run_to_completion(engine, {0: [("f", prompt, greedy(10))]})["f"]["token_ids"]
    stop_at = free[3]
    first = free.index(stop_at)
    out = run_to_completion(engine, {0: [("s", prompt, greedy(10, stop_token_ids=[stop_at]))]})["s"]
    assert out["token_ids"] == free[: first + 1] and out["finish_reason"] == "stop"


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_model_dir):
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=123, ignore_eos=True)
    prompt = prompts_of_lengths([12], seed=6)[0]
    alone = run_to_completion(make_engine(tiny_model_dir), {0: [("x", prompt, params)]})
    others = [
        (f"o{i}", p, SamplingParams(max_tokens=10, temperature=1.0))
        for i, p in enumerate(prompts_of_lengths([5, 9, 30], seed=7))
    ]
    crowd = run_to_completion(
        make_engine(tiny_model_dir), {0: others[:2], 1: [("x", prompt, params)], 3: others[2:]}
    )
    assert crowd["x"]["token_ids"] == alone["x"]["token_ids"]


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", None, "prompt"),
        ([], None, "prompt"),
        ([1, 2, 10_000], None, "prompt_token_ids[2]"),
        ([-1], None, "prompt_token_ids[0]"),
        ([5] * 5000, None, "context window"),
        ([3, 4], {"stop_token_ids": [10_000]}, "stop_token_ids"),
    ],
)
def test_bad_prompts_raise_naming_the_field(tiny_model_dir, prompt, params, field):
    engine = make_engine(tiny_model_dir)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        engine.add_request("bad", prompt, SamplingParams(**(params or {})))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kwargs", "field", "allowed"),
    [
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"temperature": -0.5}, "temperature", "[0, inf)"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_k": -1}, "top_k", ">= 0"),
        ({"min_p": 2.0}, "min_p", "[0, 1]"),
        ({"seed": -3}, "seed", "[0,"),
        ({"num_speculative_tokens": 99}, "num_speculative_tokens", "[0, 16]"),
    ],
)
def test_bad_sampling_params_name_the_field_and_range(kwargs, field, allowed):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert field in str(info.value) and allowed in str(info.value)


def test_failing_forward_is_an_error_on_every_in_flight_request(tiny_model_dir):
    import asyncio

    from engine.config import EngineConfig
    from engine.core.async_engine import AsyncEngine
    from engine.core.llm_engine import LLMEngine
    from engine.errors import EngineDeadError

    calls = {"n": 0}

    def factory(config):
        engine = LLMEngine(config)
        real = engine.runner.execute

        def flaky(prepared):
            calls["n"] += 1
            if calls["n"] == 4:
                raise RuntimeError("device fell off the bus")
            return real(prepared)

        engine.runner.execute = flaky
        return engine

    async def main():
        config = EngineConfig(
            model=tiny_model_dir, speculative_method="none", num_kv_blocks=64, device="cpu"
        )
        aengine = AsyncEngine(config, engine_factory=factory)
        aengine.start()
        await aengine.wait_ready(60)

        async def consume(i):
            async for _ in aengine.generate([5 + i, 6, 7], greedy(50)):
                pass

        results = await asyncio.wait_for(
            asyncio.gather(*(consume(i) for i in range(3)), return_exceptions=True), 30
        )
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "device fell off the bus" in str(results[0])
        assert not aengine.is_healthy
        with pytest.raises(EngineDeadError):
            async for _ in aengine.generate([5], greedy(2)):
                pass
        aengine.shutdown()

    asyncio.run(main())


def test_async_engine_streams_and_aborts_on_early_exit(tiny_model_dir):
    import asyncio

    from engine.config import EngineConfig
    from engine.core.async_engine import AsyncEngine

    async def main():
        config = EngineConfig(
            model=tiny_model_dir, speculative_method="none", num_kv_blocks=64, device="cpu"
        )
        aengine = AsyncEngine(config)
        aengine.start()
        await aengine.wait_ready(60)
        tokens = []
        async for delta in aengine.generate([5, 6, 7], greedy(6)):
            tokens += delta.token_ids
        assert tokens == hf_greedy(tiny_model_dir, [5, 6, 7], 6)
        async for _ in aengine.generate([8, 9], greedy(500)):
            break  # the client goes away
        for _ in range(100):
            if aengine.stats.target_pool.num_blocks_in_use == 0:
                break
            await asyncio.sleep(0.02)
        assert aengine.stats.target_pool.num_blocks_in_use == 0
        aengine.shutdown()

    asyncio.run(main())


def test_engine_overloaded_when_the_waiting_queue_is_full(tiny_model_dir):
    import asyncio

    from engine.config import EngineConfig
    from engine.core.async_engine import AsyncEngine
    from engine.errors import EngineOverloadedError

    async def main():
        config = EngineConfig(
            model=tiny_model_dir,
            speculative_method="none",
            num_kv_blocks=64,
            device="cpu",
            max_num_seqs=1,
            max_waiting_requests=2,
        )
        aengine = AsyncEngine(config)
        aengine.start()
        await aengine.wait_ready(60)

        async def consume(i):
            async for _ in aengine.generate([5 + i, 6], greedy(40)):
                pass

        tasks = [asyncio.create_task(consume(i)) for i in range(8)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        rejected = [r for r in results if isinstance(r, EngineOverloadedError)]
        assert rejected and len(rejected) < 8
        assert "retry" in str(rejected[0])
        aengine.shutdown()

    asyncio.run(main())


def test_logprobs_are_the_models_log_softmax(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    engine.add_request("lp", [5, 6, 7], greedy(3, logprobs=2))
    logprobs = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            logprobs += out.logprobs or []
    assert len(logprobs) == 3
    from tests.engine.engine_helpers import _hf_model

    with torch.no_grad():
        ref = torch.log_softmax(
            _hf_model(tiny_model_dir)(torch.tensor([[5, 6, 7]])).logits[0, -1], -1
        )
    first = logprobs[0]
    assert first.top[0][0] == first.token_id == int(ref.argmax())
    assert first.logprob == pytest.approx(float(ref.max()), abs=1e-4)
    assert len(first.top) == 2


def test_sliding_window_models_cap_the_context_window(tiny_model_factory):
    model_dir = tiny_model_factory(arch="mistral", sliding_window=64)
    engine = make_engine(model_dir)
    assert engine.max_model_len == 64
    with pytest.raises(ValueError, match="sliding_window"):
        make_engine(model_dir, max_model_len=128)
