"""A model whose logits are not finite never turns them into tokens (issue 33, item 4).

The kernels propagate NaN and Inf (test_kernel_nonfinite.py); this is the step after
them. Unchecked, argmax takes a NaN for the largest value and the samplers draw from it,
so a broken model produced plausible tokens. Now the request that would keep a token
drawn from a NaN or +Inf row ends with finish_reason "error", its output cut to what it
had before that step, a detail saying why; its blocks go back; every other request gets
exactly what it gets without it. A bad row that verification never reached (after a
rejected draft) is one plain decoding would never have computed: that request goes on
unchanged, so speculation stays lossless. -Inf alone is a token of probability 0.
"""

from __future__ import annotations

import shutil

import grpc
import pytest

from engine.client import SpecserveClient
from engine.config import EngineConfig
from engine.errors import ModelOutputError
from engine.io.sampling_params import SamplingParams
from engine.server.rpc_guard import to_rpc_error
from tests.engine.engine_helpers import (
    LogitPoison,
    assert_all_blocks_released,
    make_engine,
    prompts_of_lengths,
    run_to_completion,
)
from tests.server.helpers import InProcessServer, wait_no_blocks_in_use

VICTIM = "victim"
# A context that repeats, so n-gram drafts are both accepted and rejected.
REPEATING = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]


def _poison(engine, rows, value: float = float("nan"), column: int | None = None):
    """Poisons the victim's rows ``rows(num_output_tokens, drafts)``."""

    def victim_rows(request, drafts):
        if request.request_id != VICTIM:
            return []
        return rows(request.num_output_tokens, drafts)

    return LogitPoison(engine, victim_rows, value, column)


def _requests(victim_prompt=REPEATING):
    prompts = prompts_of_lengths([9, 17], seed=4)
    return [
        ("free", prompts[0], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)),
        ("seeded", prompts[1], SamplingParams(max_tokens=24, temperature=0.9, seed=11)),
        (VICTIM, victim_prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)),
    ]


def _others(results):
    return {k: (v["token_ids"], v["finish_reason"]) for k, v in results.items() if k != VICTIM}


@pytest.mark.parametrize("method", ["none", "ngram", "draft"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_row_ends_only_its_request(
    tiny_model_dir, tiny_draft_model_dir, method, value
):
    kwargs = {"speculative_method": method, "seed": 3}
    if method == "draft":
        kwargs["draft_model"] = tiny_draft_model_dir
    alone = run_to_completion(make_engine(tiny_model_dir, **kwargs), {0: _requests()})

    engine = make_engine(tiny_model_dir, **kwargs)
    poison = _poison(engine, lambda n, drafts: [0] if n >= 5 else [], value)
    results = run_to_completion(engine, {0: _requests()})
    victim = results[VICTIM]
    cut = len(victim["token_ids"])
    assert victim["finish_reason"] == "error" and poison.num_poisoned == 1
    assert 5 <= cut < 24 and victim["token_ids"] == alone[VICTIM]["token_ids"][:cut]
    assert victim["detail"] == (
        f"the model's logits were not finite (NaN or +Inf) at output token {cut}; "
        "nothing was sampled from them"
    )
    assert _others(results) == _others(alone)
    assert_all_blocks_released(engine)


def test_a_bad_row_verification_never_reaches_changes_nothing(tiny_model_dir):
    """Greedy n-gram speculation, every draft row past the first draft plain decoding
    disagrees with poisoned: the output is plain decoding's, to the token; then the
    first reached draft row poisoned: the request ends there."""
    kwargs = {"speculative_method": "ngram", "seed": 3, "num_speculative_tokens": 4}
    alone = run_to_completion(make_engine(tiny_model_dir, **kwargs), {0: _requests()})
    plain = alone[VICTIM]["token_ids"]

    def reached(n, drafts):  # rows verification uses: up to the first wrong draft
        j = 0
        while j < len(drafts) and n + j < len(plain) and drafts[j] == plain[n + j]:
            j += 1
        return j

    engine = make_engine(tiny_model_dir, **kwargs)
    unreached = _poison(engine, lambda n, d: list(range(reached(n, d) + 1, 1 + len(d))))
    results = run_to_completion(engine, {0: _requests()})
    assert unreached.num_poisoned >= 5  # drafts were rejected, their rows poisoned
    assert results[VICTIM]["token_ids"] == plain and results[VICTIM]["finish_reason"] == "length"
    assert engine.stats.num_accepted_tokens > 0
    assert _others(results) == _others(alone)

    engine = make_engine(tiny_model_dir, **kwargs)
    first_reached = _poison(engine, lambda n, d: [1] if reached(n, d) >= 1 else [])
    results = run_to_completion(engine, {0: _requests()})
    assert first_reached.num_poisoned == 1 and results[VICTIM]["finish_reason"] == "error"
    assert plain[: len(results[VICTIM]["token_ids"])] == results[VICTIM]["token_ids"]
    assert _others(results) == _others(alone)
    assert_all_blocks_released(engine)


def test_minus_infinity_alone_is_a_token_of_probability_zero(tiny_model_dir):
    kwargs = {"speculative_method": "ngram", "seed": 3}
    alone = run_to_completion(make_engine(tiny_model_dir, **kwargs), {0: _requests()})
    engine = make_engine(tiny_model_dir, **kwargs)
    never = 258  # a byte token the greedy victim never emits
    assert never not in alone[VICTIM]["token_ids"]
    _poison(engine, lambda n, d: range(1 + len(d)), float("-inf"), column=never)
    results = run_to_completion(engine, {0: _requests()})
    assert {k: (v["token_ids"], v["finish_reason"]) for k, v in results.items()} == {
        k: (v["token_ids"], v["finish_reason"]) for k, v in alone.items()
    }


@pytest.fixture(scope="module")
def broken_model_dir(tiny_model_dir, tmp_path_factory) -> tuple[str, int]:
    """The tiny model with one token's embedding row NaN (a broken checkpoint): any
    prompt holding that token gives NaN logits through every layer."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("broken-model")
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    weights = load_file(path / "model.safetensors")
    token = 77
    weights["model.embed_tokens.weight"][token] = float("nan")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path), token


def test_a_model_with_a_nan_weight_ends_the_requests_it_breaks(broken_model_dir):
    model, token = broken_model_dir
    requests = _requests(victim_prompt=[5, 6, token, 8, 9])
    assert all(token not in prompt for name, prompt, _ in requests if name != VICTIM)
    engine = make_engine(model, speculative_method="ngram", seed=3)
    results = run_to_completion(engine, {0: requests})
    assert results[VICTIM]["finish_reason"] == "error" and results[VICTIM]["token_ids"] == []
    assert "at output token 0" in results[VICTIM]["detail"]
    assert all(
        r["finish_reason"] == "length" and len(r["token_ids"]) == 24
        for k, r in results.items()
        if k != VICTIM
    )
    assert_all_blocks_released(engine)


def test_over_grpc_the_broken_request_gets_internal_and_the_server_serves_on(
    broken_model_dir,
):
    model, token = broken_model_dir
    assert to_rpc_error(ModelOutputError("x")).code == grpc.StatusCode.INTERNAL
    config = EngineConfig(model=model, device="cpu", num_kv_blocks=256)
    with InProcessServer(config) as server, SpecserveClient(server.target) as client:
        free = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
        neighbour = client.generate([5, 6, 7, 8], **free)
        first = next(iter(neighbour))
        with pytest.raises(grpc.RpcError) as info:
            for _ in client.generate([5, token, 7], **free):
                pass
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert info.value.details().startswith("the model's logits were not finite")
        rest = [t for d in neighbour for t in d.token_ids]
        assert len(first.token_ids + rest) == 16
        assert client.generate_complete([5, 6, 7, 8], **free).token_ids == first.token_ids + rest
        wait_no_blocks_in_use(client)
        assert server.engine.dead_error is None
        assert not any("engine failed" in e for e in server.errors)
