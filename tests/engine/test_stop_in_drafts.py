"""A stop string that ends inside a run of accepted drafts: everything the request
reports (token ids, text, finish and stop reason, logprobs, usage) is what the same
request reports without speculation."""

from __future__ import annotations

from engine.io.sampling_params import SamplingParams
from tests.engine.engine_helpers import (
    assert_all_blocks_released,
    make_engine,
    prompts_of_lengths,
)


def _params(stop: list[str], **kw) -> SamplingParams:
    return SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True, stop=stop, logprobs=2, **kw
    )


def _run(engine, prompt, params):
    """Per-step deltas of one request, and its collected result."""
    engine.add_request("r", prompt, params)
    deltas, logprobs, final = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.token_ids)
            logprobs += [(lp.token_id, round(lp.logprob, 5), lp.top) for lp in out.logprobs or []]
            final = out
    token_ids = [t for d in deltas for t in d]
    text = engine.tokenizer.decode(token_ids, skip_special_tokens=True)
    return deltas, {
        "token_ids": token_ids,
        "num_completion_tokens": len(token_ids),
        "finish_reason": final.finish_reason,
        "stop_reason": final.stop_reason,
        "logprobs": [(t, lp, [(i, round(v, 5)) for i, v in top]) for t, lp, top in logprobs],
        "prompt_tokens": final.metrics.num_prompt_tokens,
        "emitted_text_prefix": text,
    }


def _stops_inside_runs(tokenizer, deltas: list[list[int]]) -> list[str]:
    """Stop strings whose first occurrence ends with a token that is not the last of its
    step's delta (a run of accepted drafts went on after it)."""
    token_ids = [t for d in deltas for t in d]
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    inside, start = [], 0
    for delta in deltas:
        inside += range(start, start + len(delta) - 1)
        start += len(delta)
    stops = []
    for t in inside:
        end = len(tokenizer.decode(token_ids[: t + 1], skip_special_tokens=True))
        prefix = text[:end]
        if not text.startswith(prefix) or "\ufffd" in text[max(0, end - 8) : end + 1]:
            continue  # a multi-byte character split at this token
        for size in range(1, 9):
            stop = prefix[-size:]
            if len(stop) == size and stop.isprintable() and text.find(stop) == end - size:
                stops.append(stop)
                break
    return stops


def test_a_stop_string_inside_accepted_drafts_reports_what_plain_decoding_does(tiny_model_dir):
    plain = make_engine(tiny_model_dir)
    spec = make_engine(
        tiny_model_dir, speculative_method="ngram", speculative_disable_batch_size=64
    )
    checked = 0
    for seed in range(30, 60):
        prompt = prompts_of_lengths([4], seed=seed)[0] * 4  # repetitive: drafts accepted
        free_deltas, _ = _run(spec, prompt, _params([], num_speculative_tokens=4))
        for stop in _stops_inside_runs(spec.tokenizer, free_deltas)[:4]:
            _, expected = _run(plain, prompt, _params([stop]))
            _, got = _run(spec, prompt, _params([stop], num_speculative_tokens=4))
            assert got == expected, (seed, stop)
            assert expected["finish_reason"] == "stop" and expected["stop_reason"] == stop
            checked += 1
        if checked >= 8:
            break
    assert checked >= 8
    assert_all_blocks_released(spec)
    assert_all_blocks_released(plain)
