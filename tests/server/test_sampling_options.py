"""Penalties, logit_bias, min_tokens, include_stop_str_in_output and
truncate_prompt_tokens end to end: a speculating server gives what the plain engine
gives, and bad values are INVALID_ARGUMENT naming the proto field."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from engine.client import SpecserveClient
from engine.io.sampling_params import SamplingParams
from tests.engine.engine_helpers import make_engine, run_to_completion
from tests.server.helpers import InProcessServer, wait_no_blocks_in_use

PROMPT = [5, 9, 14, 3, 9, 27, 9, 27]
FEATURES = [
    {"repetition_penalty": 1.4},
    {"frequency_penalty": 0.8, "presence_penalty": -0.3},
    {"logit_bias": {27: -100.0, 105: 2.0}},
    {"min_tokens": 10, "stop_token_ids": [9, 258]},
]


@pytest.fixture(scope="module")
def spec_server(engine_config):
    config = dataclasses.replace(
        engine_config, speculative_method="ngram", speculative_disable_batch_size=64
    )
    with InProcessServer(config) as srv:
        yield srv


@pytest.fixture()
def spec_client(spec_server):
    with SpecserveClient(spec_server.target) as c:
        yield c


def _plain(model_dir, prompt, **kw) -> list[int]:
    params = SamplingParams(**kw)
    engine = make_engine(str(model_dir), dtype="auto")  # the servers' dtype
    return run_to_completion(engine, {0: [("r", prompt, params)]})["r"]["token_ids"]


@pytest.mark.parametrize("features", FEATURES)
def test_penalized_requests_through_a_speculating_server_match_the_plain_engine(
    spec_client, model_dir, features
):
    kw = {"max_tokens": 20, "temperature": 0.0, **features}
    expected = _plain(model_dir, PROMPT, **kw)
    assert expected != _plain(model_dir, PROMPT, max_tokens=20, temperature=0.0)
    deltas = list(spec_client.generate(PROMPT, num_speculative_tokens=3, **kw))
    assert [t for d in deltas for t in d.token_ids] == expected
    complete = spec_client.generate_complete(PROMPT, **kw)
    assert complete.token_ids == expected
    wait_no_blocks_in_use(spec_client)


def test_min_tokens_and_include_stop_str_in_output(spec_client):
    a = "a"  # token 67 of the byte-level tiny tokenizer
    kw = {"max_tokens": 12, "temperature": 0.0, "logit_bias": {67: 100.0}, "stop": [a + a]}
    early = spec_client.generate_complete([5, 6], **kw)
    assert (early.text, len(early.token_ids), early.stop_reason) == ("", 2, a + a)
    late = spec_client.generate_complete([5, 6], min_tokens=5, **kw)
    assert (late.text, len(late.token_ids), late.finish_reason) == (a * 4, 6, "stop")
    kept = spec_client.generate_complete([5, 6], include_stop_str_in_output=True, **kw)
    assert (kept.text, kept.token_ids) == (a * 2, [67, 67])


def test_truncate_prompt_tokens_keeps_the_last_tokens(spec_client, model_dir):
    max_model_len = spec_client.model_info().max_model_len
    too_long = [5 + i % 200 for i in range(max_model_len + 10)]
    with pytest.raises(grpc.RpcError) as info:
        spec_client.generate_complete(too_long, max_tokens=2)
    assert info.value.details().startswith("token_ids.ids must have between 1 and")
    kw = {"max_tokens": 6, "temperature": 0.0}
    cut = spec_client.generate_complete(too_long, truncate_prompt_tokens=30, **kw)
    assert cut.usage.prompt_tokens == 30
    assert cut.token_ids == _plain(model_dir, too_long[-30:], **kw)
    text = spec_client.generate_complete("Hello there, world", truncate_prompt_tokens=4, **kw)
    assert text.usage.prompt_tokens == 4
    assert text.token_ids == _plain(
        model_dir, spec_client.tokenize("Hello there, world")[-4:], **kw
    )
    # A text prompt longer than the context is encoded whole, then truncated.
    long_text = "abcdefgh " * (max_model_len // 8)
    assert len(spec_client.tokenize(long_text)) >= max_model_len
    with pytest.raises(grpc.RpcError) as info:
        spec_client.generate_complete(long_text, max_tokens=2)
    assert "the context window allows at most" in info.value.details()
    cut_text = spec_client.generate_complete(long_text, truncate_prompt_tokens=20, **kw)
    assert cut_text.usage.prompt_tokens == 20
    assert cut_text.token_ids == _plain(model_dir, spec_client.tokenize(long_text)[-20:], **kw)


@pytest.mark.parametrize(
    ("kwargs", "details"),
    [
        ({"frequency_penalty": 3.0}, "sampling.frequency_penalty must be in [-2, 2], got 3.0"),
        ({"presence_penalty": -2.5}, "sampling.presence_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0.0}, "sampling.repetition_penalty must be in (0, 2]"),
        ({"max_tokens": 3, "min_tokens": 4},
         "sampling.min_tokens must be in [0, 3] (sampling.max_tokens), got 4"),
        ({"logit_bias": {259: 1.0}},
         "sampling.logit_bias keys must be token ids in [0, 258] (vocab_size - 1), got 259"),
        ({"logit_bias": {7: -101.0}}, "sampling.logit_bias[7] must be in [-100, 100]"),
        ({"truncate_prompt_tokens": 0}, "sampling.truncate_prompt_tokens must be >= 1, got 0"),
    ],
)  # fmt: skip
def test_bad_values_are_invalid_argument_naming_the_field(spec_client, kwargs, details):
    with pytest.raises(grpc.RpcError) as info:
        spec_client.generate_complete([5, 6, 7], **kwargs)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(details), info.value.details()
