"""Penalties, logit bias and min_tokens: the plain engine agrees with transformers (and
with a one-sequence reference), and speculation changes nothing: each draft position is
verified under the penalties of the tokens before it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.io.sampling_params import SamplingParams
from tests.engine.engine_helpers import (
    SPEC_CONFIGS,
    _hf_model,
    assert_all_blocks_released,
    make_engine,
    prompts_of_lengths,
    run_to_completion,
    spec_kwargs,
)
from tests.engine.penalty_reference import reference_greedy
from tests.engine.test_spec_decode import LENGTHS
from tests.tiny_models import EOS_ID

# Token ids the tiny model's greedy text is full of (9, 27 and 258 repeat), so these
# features change what it says.
FEATURES = [
    {"repetition_penalty": 1.3},
    {"frequency_penalty": 0.6, "presence_penalty": 0.4},
    {"frequency_penalty": -1.0},  # rewards repeats: long n-gram runs get accepted
    {"logit_bias": {27: -100.0, 105: 3.0, 7: 0.5}},
    {"min_tokens": 12, "stop_token_ids": [9, 258], "ignore_eos": False},
    {"presence_penalty": -0.8, "repetition_penalty": 0.8, "logit_bias": {9: 0.3}},
    {"repetition_penalty": 1.8, "min_tokens": 3, "stop_token_ids": [27], "ignore_eos": False},
    {},  # a request without any of it, in the same batches
]


def _params(i: int, k: int | None = None, **extra) -> SamplingParams:
    kw = {"max_tokens": 20, "temperature": 0.0, "ignore_eos": True, "num_speculative_tokens": k}
    return SamplingParams(**{**kw, **FEATURES[i % len(FEATURES)], **extra})


def _prompts() -> list[list[int]]:
    prompts = prompts_of_lengths(LENGTHS, seed=11)
    shared = prompts_of_lengths([36], seed=12)[0]
    return prompts + [shared + [7, 8], shared + [9], prompts[2][:5] * 6, [9, 27, 258] * 5]


def _workload(k: int | None, **extra):
    """Staggered arrivals, a shared prefix, repetitive prompts; every feature mix."""
    return {i: [(f"r{i}", p, _params(i, k, **extra))] for i, p in enumerate(_prompts())}


def _token_ids(results) -> dict[str, list[int]]:
    return {rid: r["token_ids"] for rid, r in results.items()}


@pytest.fixture(scope="module")
def plain_reference(tiny_model_dir):
    return _token_ids(run_to_completion(make_engine(tiny_model_dir), _workload(None)))


def test_the_features_change_the_greedy_output(tiny_model_dir, plain_reference):
    """Else the equality tests below would prove nothing."""
    workload = {
        step: [(rid, p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))]
        for step, [(rid, p, _)] in _workload(None).items()
    }
    unpenalized = _token_ids(run_to_completion(make_engine(tiny_model_dir), workload))
    changed = [rid for rid in unpenalized if unpenalized[rid] != plain_reference[rid]]
    assert len(changed) >= len(unpenalized) - 3, changed


@pytest.mark.parametrize(
    ("method", "engine_kwargs"),
    SPEC_CONFIGS,
)
def test_penalized_greedy_speculation_is_token_for_token_the_plain_output(
    tiny_model_dir, spec_draft_dirs, plain_reference, method, engine_kwargs
):
    kwargs = spec_kwargs(method, engine_kwargs, spec_draft_dirs)
    kwargs["speculative_disable_batch_size"] = 64
    engine = make_engine(tiny_model_dir, num_speculative_tokens=4, **kwargs)
    for k in (1, 4, None):  # fixed k, then adaptive
        drafted, accepted = engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens
        results = run_to_completion(engine, _workload(k))
        assert _token_ids(results) == plain_reference, k
        assert_all_blocks_released(engine)
        assert engine.stats.num_draft_tokens > drafted
        assert engine.stats.num_accepted_tokens > accepted


@pytest.mark.parametrize("seeded", [False, True])
def test_a_draft_identical_to_the_target_drafts_under_the_same_penalties(tiny_model_dir, seeded):
    """The draft model's step j counts d_1..d_{j-1} and knows its position for
    min_tokens, as the verifier does: a draft equal to the target is always accepted,
    greedy or seeded."""
    engine = make_engine(tiny_model_dir, speculative_method="draft", draft_model=tiny_model_dir)
    extra = {"temperature": 0.8, "seed": 5} if seeded else {}
    results = run_to_completion(engine, _workload(4, **extra))
    for rid, r in results.items():
        m = r["metrics"]
        assert m.num_draft_tokens > 0 and m.num_accepted_tokens == m.num_draft_tokens, rid
    assert_all_blocks_released(engine)


@pytest.mark.parametrize(
    ("method", "engine_kwargs"),
    [("ngram", {"num_kv_blocks": 12}), ("draft", {"max_num_batched_tokens": 24})],
)
def test_a_penalized_seeded_request_is_the_same_alone_and_in_a_speculating_crowd(
    tiny_model_dir, tiny_draft_model_dir, method, engine_kwargs
):
    """The seeded contract with these features: each request alone in a plain engine
    (another engine seed) gives what it gives in a crowd, speculating, preempted or
    chunked."""
    seeded = {"temperature": 0.7, "seed": 123}
    kwargs = dict(speculative_method=method, speculative_disable_batch_size=64, **engine_kwargs)
    if method == "draft":
        kwargs["draft_model"] = tiny_draft_model_dir
    crowd = _token_ids(
        run_to_completion(make_engine(tiny_model_dir, **kwargs), _workload(3, **seeded))
    )
    for step, [(rid, prompt, _)] in _workload(None, **seeded).items():
        params = _params(step, None, **seeded)
        alone = run_to_completion(
            make_engine(tiny_model_dir, seed=99), {0: [(rid, prompt, params)]}
        )
        assert crowd[rid] == alone[rid]["token_ids"], rid


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_row_sees_the_drafts_before_it_as_repeated_tokens(
    tiny_model_dir, tiny_draft_model_dir, method
):
    """Two biased tokens the prompt does not hold: the repetition penalty makes them
    alternate until both are seen, so whether a row counts the drafts before it (not
    only the output) decides what it samples. Both models see the same bias."""
    params = SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, num_speculative_tokens=4,
        repetition_penalty=1.3, logit_bias={67: 10.0, 68: 9.0},
    )  # fmt: skip
    prompt = [5, 9, 14, 3]
    plain = _engine_greedy(
        tiny_model_dir, prompt, dataclasses.replace(params, num_speculative_tokens=None)
    )
    expected = _hf_generate(
        tiny_model_dir, prompt, 12, min_new_tokens=12, repetition_penalty=1.3,
        sequence_bias=[[[67], 10.0], [[68], 9.0]],
    )  # fmt: skip
    assert plain == expected and plain[:3] == [67, 68, 67]
    kwargs = {"draft_model": tiny_draft_model_dir} if method == "draft" else {}
    engine = make_engine(tiny_model_dir, speculative_method=method, **kwargs)
    result = run_to_completion(engine, {0: [("r", prompt, params)]})["r"]
    assert result["token_ids"] == plain
    assert result["metrics"].num_accepted_tokens > 0


# ---- the plain engine against transformers ----------------------------------------------


def _engine_greedy(model_dir: str, prompt: list[int], params: SamplingParams) -> list[int]:
    return run_to_completion(make_engine(model_dir), {0: [("r", prompt, params)]})["r"]["token_ids"]


def _hf_generate(model_dir: str, prompt: list[int], max_tokens: int, **kw) -> list[int]:
    with torch.no_grad():
        out = _hf_model(model_dir).generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0, **kw
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    ("params", "hf_kwargs"),
    [
        ({"repetition_penalty": 1.4}, {"repetition_penalty": 1.4}),
        ({"repetition_penalty": 0.7}, {"repetition_penalty": 0.7}),
        (
            {"logit_bias": {27: -100.0, 105: 2.0}},
            {"sequence_bias": [[[27], -100.0], [[105], 2.0]]},
        ),
        (  # both: bias first, then the penalty, in transformers as in the engine
            {"logit_bias": {9: 1.5, 58: -0.7}, "repetition_penalty": 1.6},
            {"sequence_bias": [[[9], 1.5], [[58], -0.7]], "repetition_penalty": 1.6},
        ),
    ],
)
def test_repetition_penalty_and_logit_bias_match_transformers(tiny_model_dir, params, hf_kwargs):
    prompt = [5, 9, 14, 3, 9, 27]
    plain = _hf_generate(tiny_model_dir, prompt, 24, min_new_tokens=24)
    expected = _hf_generate(tiny_model_dir, prompt, 24, min_new_tokens=24, **hf_kwargs)
    assert expected != plain
    # min_new_tokens masks EOS in transformers; min_tokens does the same here
    params = SamplingParams(max_tokens=24, min_tokens=24, temperature=0, **params)
    assert _engine_greedy(tiny_model_dir, prompt, params) == expected


def test_min_tokens_matches_transformers_min_new_tokens(tiny_model_dir):
    prompt = [5, 9, 14, 3]
    stops = [9, 258]
    early = _hf_generate(tiny_model_dir, prompt, 30, eos_token_id=[EOS_ID, *stops])
    assert len(early) < 8 and early[-1] in stops  # it would stop before min_tokens
    expected = _hf_generate(
        tiny_model_dir, prompt, 30, eos_token_id=[EOS_ID, *stops], min_new_tokens=8
    )
    params = SamplingParams(max_tokens=30, temperature=0, min_tokens=8, stop_token_ids=stops)
    got = _engine_greedy(tiny_model_dir, prompt, params)
    assert got == expected and len(got) > 8 and got[-1] in stops


@pytest.mark.parametrize(
    "features",
    [
        {"frequency_penalty": 0.7},
        {"presence_penalty": 0.9},
        {"frequency_penalty": -0.5, "presence_penalty": 0.4},
        {"frequency_penalty": 2.0, "presence_penalty": -2.0, "repetition_penalty": 1.2,
         "logit_bias": {9: 0.4}, "min_tokens": 5, "stop_token_ids": [258], "ignore_eos": False},
    ],
)  # fmt: skip
def test_frequency_and_presence_penalties_match_the_reference(tiny_model_dir, features):
    prompt = [5, 9, 14, 3]
    kw = {"ignore_eos": True, **features}
    params = SamplingParams(max_tokens=24, temperature=0.0, **kw)
    expected = reference_greedy(tiny_model_dir, prompt, params, {EOS_ID})
    assert expected != _hf_generate(tiny_model_dir, prompt, len(expected))
    assert _engine_greedy(tiny_model_dir, prompt, params) == expected


def test_logprobs_stay_the_raw_models(tiny_model_dir):
    prompt = [5, 9, 14, 3]
    biased = SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, logprobs=1, logit_bias={27: 100.0}
    )
    engine = make_engine(tiny_model_dir)
    engine.add_request("r", prompt, biased)
    logprobs = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            logprobs += out.logprobs or []
    assert [lp.token_id for lp in logprobs] == [27] * 6
    model = _hf_model(tiny_model_dir)
    with torch.no_grad():
        raw = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
    assert logprobs[0].logprob == pytest.approx(raw[27].item(), abs=1e-4)
    assert logprobs[0].top[0][0] == int(raw.argmax()) != 27


# ---- min_tokens, stop strings, include_stop_str_in_output ----------------------------------

A, B = 67, 68  # the byte-level tiny tokenizer's "a" and "b"


def _a_text(model_dir) -> str:
    return make_engine(model_dir).tokenizer.decode([A])


@pytest.mark.parametrize("method", ["none", "ngram", "draft"])
def test_min_tokens_holds_stop_tokens_and_strings_back(
    tiny_model_dir, tiny_draft_model_dir, method
):
    """A +100 bias makes every token A, unless masked: the stop token A cannot come
    before min_tokens; the stop string "AA" counts only in tokens after the first
    min_tokens.
    "boundary" drafts runs of B (+50) across min_tokens: the row at min_tokens must
    sample A (unmasked) although the rows before it in the same pass are masked."""
    a = _a_text(tiny_model_dir)
    kwargs = {"speculative_method": method, "speculative_disable_batch_size": 64}
    if method == "draft":
        kwargs["draft_model"] = tiny_draft_model_dir
    engine = make_engine(tiny_model_dir, **kwargs)
    base = {"max_tokens": 20, "temperature": 0.0, "logit_bias": {A: 100.0}, "ignore_eos": True}
    boundary = {**base, "logit_bias": {A: 100.0, B: 50.0}, "stop_token_ids": [A]}
    boundary["num_speculative_tokens"] = None if method == "none" else 4
    workload = {0: [
        ("token", [A, 5] * 6, SamplingParams(**base, min_tokens=7, stop_token_ids=[A])),
        ("boundary6", [B] * 12, SamplingParams(**boundary, min_tokens=6)),
        ("boundary7", [B] * 12, SamplingParams(**boundary, min_tokens=7)),
        ("string", [A] * 8, SamplingParams(**base, min_tokens=6, stop=[a + a])),
        ("early", [A] * 8, SamplingParams(**base, stop=[a + a])),
        ("kept", [A] * 8, SamplingParams(**base, min_tokens=4, stop=[a + a],
                                        include_stop_str_in_output=True)),
    ]}  # fmt: skip
    results = run_to_completion(engine, workload)
    token = results["token"]["token_ids"]
    assert len(token) == 8 and A not in token[:7] and token[7] == A
    assert results["token"]["finish_reason"] == "stop"
    assert results["boundary6"]["token_ids"] == [B] * 6 + [A]
    assert results["boundary7"]["token_ids"] == [B] * 7 + [A]
    # The 7th A is the first token after min_tokens: it completes the stop string.
    assert results["string"]["token_ids"] == [A] * 7 and results["string"]["text"] == a * 5
    assert results["early"]["token_ids"] == [A] * 2 and results["early"]["text"] == ""
    assert results["kept"]["token_ids"] == [A] * 5 and results["kept"]["text"] == a * 5
    assert all(r["finish_reason"] == "stop" for r in results.values())
    assert_all_blocks_released(engine)


def test_include_stop_str_in_output_keeps_the_stop_string(tiny_model_dir, tiny_draft_model_dir):
    prompt = [5, 9, 14, 3]
    plain = _engine_greedy(tiny_model_dir, prompt, SamplingParams(max_tokens=20, temperature=0))
    text = make_engine(tiny_model_dir).tokenizer.decode(plain)
    at = next(
        i for i in range(3, 18) if text[i : i + 2].isascii() and text.find(text[i : i + 2]) == i
    )
    stop = text[at : at + 2]
    for method in ("none", "ngram", "draft"):
        kwargs = {"draft_model": tiny_draft_model_dir} if method == "draft" else {}
        engine = make_engine(tiny_model_dir, speculative_method=method, **kwargs)
        results = run_to_completion(engine, {0: [
            ("cut", prompt, SamplingParams(max_tokens=20, temperature=0, stop=[stop])),
            ("kept", prompt, SamplingParams(max_tokens=20, temperature=0, stop=[stop],
                                            include_stop_str_in_output=True)),
        ]})  # fmt: skip
        assert results["cut"]["text"] == text[:at]
        assert results["kept"]["text"] == text[: at + 2]
        assert results["kept"]["token_ids"] == results["cut"]["token_ids"]


# ---- truncate_prompt_tokens and logit_bias keys ---------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_model_len=64)
    long_ids = prompts_of_lengths([100], seed=31)[0]
    with pytest.raises(ValueError, match="prompt has 100 tokens"):
        engine.add_request("x", long_ids, SamplingParams(max_tokens=4))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, truncate_prompt_tokens=20)
    text = "a text prompt that is far longer than twenty byte tokens"
    messages = [{"role": "user", "content": text}]
    templated = engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    chat_ids = engine.tokenizer.encode(templated, add_special_tokens=False)
    cases = {
        "ids": (long_ids, long_ids[-20:]),
        "text": (text, engine.tokenizer.encode(text)[-20:]),
        "chat": (messages, chat_ids[-20:]),
    }
    for rid, (prompt, expected_prompt) in cases.items():
        if rid == "chat":
            engine.add_request(rid, None, params, messages=prompt)
        else:
            engine.add_request(rid, prompt, params)
        assert engine.scheduler.requests[rid].prompt_token_ids == expected_prompt
    results = run_to_completion(engine)
    for rid, (_, expected_prompt) in cases.items():
        alone = _engine_greedy(tiny_model_dir, expected_prompt, params)
        assert results[rid]["token_ids"] == alone
        assert results[rid]["metrics"].num_prompt_tokens == 20
    short = SamplingParams(max_tokens=4, truncate_prompt_tokens=50)
    engine.add_request("short", [5, 6, 7], short)  # shorter than n: kept whole
    assert engine.scheduler.requests["short"].prompt_token_ids == [5, 6, 7]


def test_logit_bias_outside_the_vocabulary_is_refused_by_name(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    with pytest.raises(ValueError, match=r"^logit_bias contains token id 259, outside the voc"):
        engine.add_request("x", [5, 6], SamplingParams(logit_bias={5: 1.0, 259: 1.0}))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"frequency_penalty": 2.5}, r"^frequency_penalty must be in \[-2, 2\], got 2.5"),
        ({"frequency_penalty": float("nan")}, r"^frequency_penalty must be a number in \[-2, 2\]"),
        ({"presence_penalty": -2.01}, r"^presence_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0.0}, r"^repetition_penalty must be in \(0, 2\], got 0.0"),
        ({"repetition_penalty": 2.5}, r"^repetition_penalty must be in \(0, 2\]"),
        ({"repetition_penalty": -1.0}, r"^repetition_penalty must be in \(0, 2\]"),
        ({"min_tokens": -1}, r"^min_tokens must be \[0, 16\]"),
        ({"min_tokens": 17}, r"^min_tokens must be \[0, 16\], got 17"),
        ({"max_tokens": 4, "min_tokens": 5}, r"^min_tokens must be \[0, 4\]"),
        ({"min_tokens": 1.5}, r"^min_tokens must be an integer"),
        ({"logit_bias": {3: 101.0}}, r"^logit_bias\[3\] must be in \[-100, 100\], got 101.0"),
        ({"logit_bias": {3: float("-inf")}}, r"^logit_bias\[3\] must be in \[-100, 100\]"),
        ({"logit_bias": {-1: 1.0}}, r"^logit_bias token id must be >= 0, got -1"),
        ({"logit_bias": {"7": 1.0}}, r"^logit_bias token id must be an integer"),
        ({"logit_bias": {i: 0.0 for i in range(1025)}},
         r"^logit_bias must have at most 1024 entries, got 1025"),
        ({"logit_bias": [1, 2]}, r"^logit_bias must be a mapping"),
        ({"include_stop_str_in_output": 1}, r"^include_stop_str_in_output must be true or"),
        ({"truncate_prompt_tokens": 0}, r"^truncate_prompt_tokens must be >= 1, got 0"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_naming_the_field_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_processes_logits_only_when_a_feature_is_on():
    assert not SamplingParams().processes_logits
    assert not SamplingParams(frequency_penalty=0.0, repetition_penalty=1.0).processes_logits
    for kw in ({"min_tokens": 1}, {"logit_bias": {1: 0.0}}, {"presence_penalty": 0.1}):
        assert SamplingParams(**kw).processes_logits
