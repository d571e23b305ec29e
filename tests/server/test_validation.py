"""Edge validation: every bad field is InvalidArgument naming the field and its range."""

from __future__ import annotations

import itertools

import pytest

from engine.client import build_request
from engine.rpc import generation_pb2 as pb
from engine.server.validation import InvalidArgument, ModelLimits, to_engine_request
from tests.server.helpers import fastest_s

LIMITS = ModelLimits(vocab_size=320, max_model_len=512, max_spec_tokens=4)


def check(request: pb.GenerateRequest):
    return to_engine_request(request, LIMITS)


def test_defaults_and_fields_pass_through():
    req = check(
        build_request(
            "hi", max_tokens=5, temperature=0.0, top_k=10, top_p=0.5, min_p=0.1, seed=7,
            stop=["x"], stop_token_ids=[3], ignore_eos=True, top_logprobs=2,
            num_speculative_tokens=3, priority=-4, request_id="abc-1",
        )
    )  # fmt: skip
    p = req.params
    assert (req.prompt, req.messages, req.priority, req.request_id) == ("hi", None, -4, "abc-1")
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.stop, p.stop_token_ids) == (
        5, 0.0, 10, 7, ["x"], [3],
    )  # fmt: skip
    assert p.top_p == pytest.approx(0.5) and p.min_p == pytest.approx(0.1)
    assert (p.ignore_eos, p.logprobs, p.num_speculative_tokens) == (True, 2, 3)
    default = check(build_request([1, 2, 3]))
    assert default.prompt == [1, 2, 3] and default.params.max_tokens == 16
    assert default.params.num_speculative_tokens is None and default.request_id is None


def test_logit_options_pass_through():
    req = check(
        build_request(
            [1] * 600, max_tokens=9, frequency_penalty=-0.5, presence_penalty=2.0,
            repetition_penalty=1.25, min_tokens=9, logit_bias={3: -100.0, 319: 2.5},
            include_stop_str_in_output=True, truncate_prompt_tokens=511,
        )
    )  # fmt: skip
    p = req.params
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (-0.5, 2.0, 1.25)
    assert (p.min_tokens, p.logit_bias, p.include_stop_str_in_output) == (
        9, {3: -100.0, 319: 2.5}, True,
    )  # fmt: skip
    assert p.truncate_prompt_tokens == 511 and len(req.prompt) == 511  # cut before it is read
    default = check(build_request("x")).params
    assert (default.repetition_penalty, default.min_tokens, default.logit_bias) == (1.0, 0, {})
    assert default.truncate_prompt_tokens is None and not default.processes_logits


def test_truncation_reads_only_the_ids_it_keeps():
    """The last n ids, range-checked; the rest is never read (15M ids held the event
    loop over a second when each one was checked and copied)."""
    huge = build_request([5], truncate_prompt_tokens=16)
    huge.token_ids.ids.extend(itertools.repeat(5, 5_000_000))
    huge.token_ids.ids.extend(range(100, 116))
    assert check(huge).prompt == list(range(100, 116))
    # Against reading every id once, timed here and now: reading and checking each one
    # took 0.4 s; reading only the kept ones, well under a millisecond.
    kept_s = fastest_s(lambda: check(huge))
    assert kept_s < fastest_s(lambda: list(huge.token_ids.ids)) / 4
    request = build_request([1] * 600 + [7, 8, 9], truncate_prompt_tokens=3)
    assert check(request).prompt == [7, 8, 9]
    # Ids that truncation drops are never read, so never refused.
    dropped_is_out_of_range = build_request([999] * 600 + [7, 8, 9], truncate_prompt_tokens=3)
    assert check(dropped_is_out_of_range).prompt == [7, 8, 9]
    with pytest.raises(InvalidArgument, match=r"^token_ids.ids must be in \[0, 319\]"):
        check(build_request([1] * 600 + [7, 320, 9], truncate_prompt_tokens=3))


def test_speculation_off_and_top_k_clamped_to_off():
    req = check(build_request("hi", num_speculative_tokens=0, top_k=10_000))
    assert req.params.num_speculative_tokens == 0
    assert req.params.top_k == 0  # >= vocab_size keeps every token: the filter is off


def test_chat_messages():
    req = check(build_request(messages=[{"role": "user", "content": "hi"}]))
    assert req.prompt is None and req.messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "request_kwargs, field, allowed",
    [
        ({}, "prompt", "one of text, token_ids, chat"),
        ({"prompt": ""}, "text", "non-empty"),
        ({"prompt": [1, 320]}, "token_ids.ids", "[0, 319]"),
        ({"prompt": [1] * 512}, "token_ids.ids", "511"),
        ({"messages": []}, "chat.messages", "at least one"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "chat.messages[0].role", "one of"),
        ({"prompt": "x" * 32769}, "text", "at most 32768 characters"),
        ({"messages": [{"role": "user", "content": "x" * 32769}]}, "chat", "at most 32768"),
        ({"prompt": "x", "max_tokens": 0}, "sampling.max_tokens", "[1, 512]"),
        ({"prompt": "x", "max_tokens": 513}, "sampling.max_tokens", "[1, 512]"),
        ({"prompt": "x", "temperature": -1.0}, "sampling.temperature", "[0, inf)"),
        ({"prompt": "x", "temperature": float("inf")}, "sampling.temperature", "finite"),
        ({"prompt": "x", "temperature": float("nan")}, "sampling.temperature", "finite"),
        ({"prompt": "x", "top_p": 0.0}, "sampling.top_p", "(0, 1]"),
        ({"prompt": "x", "top_p": 1.5}, "sampling.top_p", "(0, 1]"),
        ({"prompt": "x", "min_p": 2.0}, "sampling.min_p", "[0, 1]"),
        ({"prompt": "x", "seed": 2**63}, "sampling.seed", "[0, 9223372036854775807]"),
        ({"prompt": "x", "stop": [""]}, "sampling.stop", "1 to 256"),
        ({"prompt": "x", "stop": ["s"] * 17}, "sampling.stop", "at most 16"),
        ({"prompt": "x", "stop_token_ids": [320]}, "sampling.stop_token_ids", "[0, 319]"),
        ({"prompt": "x", "stop_token_ids": [1] * 65}, "sampling.stop_token_ids", "at most 64"),
        ({"prompt": "x", "top_logprobs": 21}, "sampling.top_logprobs", "[0, 20]"),
        ({"prompt": "x", "num_speculative_tokens": 5}, "speculation.num_speculative_tokens",
         "[1, 4] (the server's num_speculative_tokens)"),
        ({"prompt": "x", "num_speculative_tokens": 17}, "speculation.num_speculative_tokens",
         "[1, 4]"),
        ({"prompt": "x", "frequency_penalty": 2.5}, "sampling.frequency_penalty", "[-2, 2]"),
        ({"prompt": "x", "frequency_penalty": float("nan")}, "sampling.frequency_penalty",
         "[-2, 2]"),
        ({"prompt": "x", "presence_penalty": -3.0}, "sampling.presence_penalty", "[-2, 2]"),
        ({"prompt": "x", "repetition_penalty": 0.0}, "sampling.repetition_penalty", "(0, 2]"),
        ({"prompt": "x", "repetition_penalty": 2.5}, "sampling.repetition_penalty", "(0, 2]"),
        ({"prompt": "x", "min_tokens": 17}, "sampling.min_tokens",
         "[0, 16] (sampling.max_tokens), got 17"),
        ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "sampling.min_tokens", "[0, 4]"),
        ({"prompt": "x", "logit_bias": {320: 1.0}}, "sampling.logit_bias keys",
         "[0, 319] (vocab_size - 1), got 320"),
        ({"prompt": "x", "logit_bias": {5: 100.5}}, "sampling.logit_bias[5]", "[-100, 100]"),
        ({"prompt": "x", "logit_bias": {5: float("nan")}}, "sampling.logit_bias[5]",
         "[-100, 100]"),
        ({"prompt": "x", "logit_bias": {i: 1.0 for i in range(1025)}}, "sampling.logit_bias",
         "at most 1024 entries, got 1025"),
        ({"prompt": "x", "truncate_prompt_tokens": 0}, "sampling.truncate_prompt_tokens",
         ">= 1, got 0"),
        ({"prompt": [1] * 600, "truncate_prompt_tokens": 512}, "token_ids.ids",
         "(max_model_len - 1) after sampling.truncate_prompt_tokens, got 512"),
        ({"prompt": "x", "priority": 1001}, "priority", "[-1000, 1000]"),
        ({"prompt": "x", "request_id": ""}, "request_id", "1 to 128"),
        ({"prompt": "x", "request_id": "a b"}, "request_id", "printable ASCII"),
        ({"prompt": "x", "request_id": "x" * 129}, "request_id", "1 to 128"),
    ],
)  # fmt: skip
def test_bad_field_names_field_and_range(request_kwargs, field, allowed):
    with pytest.raises(InvalidArgument) as info:
        check(build_request(**request_kwargs))
    message = str(info.value)
    assert message.startswith(field), message
    assert allowed in message, message


def test_bad_speculation_mode_and_stray_k():
    request = build_request("x")
    request.speculation.mode = 7  # an enum value from a newer client
    with pytest.raises(InvalidArgument, match=r"^speculation\.mode must be one of"):
        check(request)
    request.speculation.mode = pb.SpeculationOptions.MODE_OFF
    request.speculation.num_speculative_tokens = 3
    with pytest.raises(InvalidArgument, match=r"^speculation\.num_speculative_tokens must be 0"):
        check(request)


def test_fixed_speculation_on_a_server_without_it_names_the_mode():
    limits = ModelLimits(vocab_size=320, max_model_len=512, max_spec_tokens=0)
    with pytest.raises(InvalidArgument, match=r"^speculation\.mode MODE_FIXED needs"):
        to_engine_request(build_request("x", num_speculative_tokens=1), limits)
    off = to_engine_request(build_request("x", num_speculative_tokens=0), limits)
    assert off.params.num_speculative_tokens == 0


def test_model_info_sets_the_speculation_limit():
    info = {"vocab_size": 9, "max_model_len": 8, "num_speculative_tokens": 6}
    assert ModelLimits.from_model_info({**info, "speculative_method": "ngram"}).max_spec_tokens == 6
    assert ModelLimits.from_model_info({**info, "speculative_method": "none"}).max_spec_tokens == 0
