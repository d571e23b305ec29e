"""Speculative decoding end to end: lossless for greedy and for sampling, and the
KV bookkeeping of both pools survives every step."""

from __future__ import annotations

import pytest

from engine.io.sampling_params import SamplingParams
from tests.engine.engine_helpers import (
    SPEC_CONFIGS,
    assert_all_blocks_released,
    greedy,
    make_engine,
    prompts_of_lengths,
    run_to_completion,
    spec_kwargs,
)

LENGTHS = [1, 15, 16, 17, 33, 50, 7, 24]


def _workload(k: int | None):
    """Mixed lengths, a shared prefix (prefix hits), repetitive prompts (n-gram hits),
    staggered arrivals."""
    prompts = prompts_of_lengths(LENGTHS, seed=11)
    shared = prompts_of_lengths([36], seed=12)[0]
    prompts += [shared + [7, 8], shared + [9], (prompts[2][:5] * 6)]
    return {i: [(f"r{i}", p, greedy(20, num_speculative_tokens=k))] for i, p in enumerate(prompts)}


def _greedy_reference(model_dir, dtype="float32"):
    return run_to_completion(make_engine(model_dir, dtype=dtype), _workload(None))


# bfloat16 too: verification runs 1 + k rows where plain decoding runs one, so this holds
# only because every kernel and GEMM computes a row the same whatever the batch around it.
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("method", "engine_kwargs"),
    SPEC_CONFIGS,
)
def test_greedy_speculation_is_token_for_token_the_targets_output(
    tiny_model_dir, spec_draft_dirs, method, engine_kwargs, dtype
):
    reference = _greedy_reference(tiny_model_dir, dtype)
    kwargs = spec_kwargs(method, engine_kwargs, spec_draft_dirs)
    kwargs.update(speculative_disable_batch_size=64, dtype=dtype)
    engine = make_engine(tiny_model_dir, **kwargs)
    for k in (1, 4):
        results = run_to_completion(engine, _workload(k))
        for request_id, ref in reference.items():
            assert results[request_id]["token_ids"] == ref["token_ids"], (k, request_id)
        assert_all_blocks_released(engine)
    assert engine.stats.num_draft_tokens > 0
    if method == "ngram":
        assert engine.stats.num_accepted_tokens > 0


def test_a_draft_identical_to_the_target_is_always_accepted(tiny_model_dir):
    engine = make_engine(tiny_model_dir, speculative_method="draft", draft_model=tiny_model_dir)
    results = run_to_completion(engine, _workload(4))
    for r in results.values():
        m = r["metrics"]
        assert m.num_draft_tokens > 0 and m.num_accepted_tokens == m.num_draft_tokens
    assert_all_blocks_released(engine)


def test_adaptive_speculation_is_lossless_too(tiny_model_dir, tiny_draft_model_dir):
    reference = _greedy_reference(tiny_model_dir)
    engine = make_engine(tiny_model_dir, speculative_method="ngram", num_speculative_tokens=6)
    results = run_to_completion(engine, _workload(None))
    assert {k: v["token_ids"] for k, v in results.items()} == {
        k: v["token_ids"] for k, v in reference.items()
    }


def test_rejected_drafts_give_their_blocks_back_every_step(tiny_model_dir, tiny_draft_model_dir):
    """check_pools() (run after every step) asserts each request holds exactly
    ceil(num_computed / block_size) blocks; here most drafts are rejected."""
    engine = make_engine(
        tiny_model_dir,
        speculative_method="draft",
        draft_model=tiny_draft_model_dir,
        num_speculative_tokens=8,
    )
    prompt = prompts_of_lengths([14], seed=13)[0]
    engine.add_request("a", prompt, greedy(40, num_speculative_tokens=8))
    baseline = None
    while engine.has_unfinished_requests():
        engine.step()
        if engine.has_unfinished_requests():
            request = engine.scheduler.requests["a"]
            held = len(engine.kv_manager.get_block_ids("a"))
            assert held == -(-request.num_computed_tokens // 16)
            free = engine.kv_manager.num_free_blocks
            expected = engine.kv_manager.num_blocks - held
            assert free == expected
            baseline = free
    assert baseline is not None
    assert engine.stats.num_draft_tokens > engine.stats.num_accepted_tokens
    assert_all_blocks_released(engine)


def test_vocabulary_mismatch_is_a_clear_error(tiny_model_dir, tiny_model_factory):
    other = tiny_model_factory(vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary"):
        make_engine(tiny_model_dir, speculative_method="draft", draft_model=other)


# Sampled output follows the target's distribution: tests/engine/test_lossless_sampling.py.


def test_engine_prices_verification_from_its_own_steps(tiny_model_dir):
    """The engine feeds decode/verification step times to the scheduler's cost model,
    and on CPU speculation stops above 4 running requests unless configured."""
    engine = make_engine(tiny_model_dir, speculative_method="ngram")
    assert engine.scheduler.config.spec_disable_batch_size == 4  # the CPU default
    workload = {i: [(f"c{i}", p, greedy(24))] for i, p in enumerate(prompts_of_lengths(
        [5, 9, 14, 3], seed=3))}  # fmt: skip
    run_to_completion(engine, workload)
    model = engine.scheduler.cost_model
    assert model._steps >= 8  # decode steps observed, prefill steps left out
    fitted = model.fit()
    assert fitted is not None and fitted[0] > 0 and fitted[1] >= 0
    assert 0 <= model.verify_cost(4) < 1
    configured = make_engine(
        tiny_model_dir, speculative_method="ngram", speculative_disable_batch_size=9
    )
    assert configured.scheduler.config.spec_disable_batch_size == 9


# ---- limits: one source of truth each ----------------------------------------------------


def test_a_request_cannot_ask_for_more_drafts_than_its_engine(tiny_model_dir):
    from engine.config import EngineConfig
    from engine.io.sampling_params import MAX_NUM_SPECULATIVE_TOKENS

    engine = make_engine(tiny_model_dir, speculative_method="ngram", num_speculative_tokens=3)
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be in \[0, 3\] \(the eng"):
        engine.add_request("k", [5, 6, 7], greedy(4, num_speculative_tokens=4))
    plain = make_engine(tiny_model_dir)
    with pytest.raises(ValueError, match="this engine does not speculate"):
        plain.add_request("k", [5, 6, 7], greedy(4, num_speculative_tokens=1))
    assert not engine.has_unfinished_requests() and not plain.has_unfinished_requests()
    top = MAX_NUM_SPECULATIVE_TOKENS
    for make in (
        lambda: SamplingParams(num_speculative_tokens=top + 1),
        lambda: EngineConfig(num_speculative_tokens=top + 1),
    ):
        with pytest.raises(ValueError, match=rf"num_speculative_tokens must be .*{top}\]"):
            make()


def test_the_scheduler_never_grants_more_than_the_engines_k(tiny_model_dir):
    """The engine's limit holds in the scheduler too, whatever a Request carries."""
    engine = make_engine(tiny_model_dir, speculative_method="ngram", num_speculative_tokens=2)
    engine.add_request("r", [5, 6, 5, 6, 5, 6, 5, 6], greedy(30))
    engine.scheduler.requests["r"].max_spec_tokens = 9  # bypassing add_request's check
    schedule = engine.scheduler.schedule
    granted: list[int] = []

    def recording_schedule():
        out = schedule()
        granted.extend(s.num_spec_tokens for s in out.scheduled)
        return out

    engine.scheduler.schedule = recording_schedule
    while engine.has_unfinished_requests():
        engine.step()
    assert max(granted) == 2


# ---- the draft model's cache never covers the last verified token ------------------------


def test_a_recovered_token_equal_to_the_rejected_draft_keeps_the_engine_alive(
    tiny_model_dir, tiny_draft_model_dir
):
    """Rejecting d1 and recovering d1 itself (the rejection sampler's round-off fallback
    can do that) leaves every fed draft verified: the draft must still re-feed the last
    verified token, or its next burst has nothing to feed."""
    engine = make_engine(
        tiny_model_dir,
        speculative_method="draft",
        draft_model=tiny_draft_model_dir,
        speculative_disable_batch_size=64,
    )
    verify = engine.verifier.verify
    forced = 0

    def reject_first_but_recover_it(
        logits, sched, states, drafts, draft_probs, masks=None, parents=None
    ):
        nonlocal forced
        result = verify(logits, sched, states, drafts, draft_probs, masks, parents)
        items = [s for s in sched.scheduled if s.needs_sample]
        for item, draft in zip(items, drafts):
            if len(draft) >= 2:
                result.sampled_token_ids[item.request_id] = draft[:1]
                result.num_accepted[item.request_id] = 0
                result.logprobs.pop(item.request_id, None)
                forced += 1
        return result

    engine.verifier.verify = reject_first_but_recover_it
    prompts = prompts_of_lengths([9, 20, 33], seed=17)
    workload = {0: [(f"r{i}", p, greedy(30, num_speculative_tokens=3)) for i, p in
                    enumerate(prompts)]}  # fmt: skip
    results = run_to_completion(engine, workload)
    assert forced > 10
    assert all(len(r["token_ids"]) == 30 for r in results.values())
    assert_all_blocks_released(engine)


def test_a_draft_with_a_shorter_context_bounds_the_pair(tiny_model_dir, tiny_model_factory):
    short_draft = tiny_model_factory(max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"max_model_len must be <= 64 \(the draft model's"):
        make_engine(
            tiny_model_dir, speculative_method="draft", draft_model=short_draft, max_model_len=100
        )
    engine = make_engine(
        tiny_model_dir,
        speculative_method="draft",
        draft_model=short_draft,
        speculative_disable_batch_size=64,
    )
    assert engine.max_model_len == 64
    prompt = prompts_of_lengths([50], seed=18)[0]
    result = run_to_completion(engine, {0: [("r", prompt, greedy(100))]})["r"]
    assert result["finish_reason"] == "length" and len(result["token_ids"]) == 14
    assert engine.stats.num_draft_tokens > 0
    assert_all_blocks_released(engine)


def test_the_draft_catch_up_shares_the_step_token_budget(tiny_model_dir, tiny_draft_model_dir):
    """A long prompt's first burst is fed to the draft in budget-sized chunks (no drafts
    until it has caught up), and the output is still the target's greedy output."""
    prompts = prompts_of_lengths([60, 45], seed=19)
    workload = {0: [(f"r{i}", p, greedy(12, num_speculative_tokens=2)) for i, p in
                    enumerate(prompts)]}  # fmt: skip
    reference = run_to_completion(make_engine(tiny_model_dir), {0: [
        (rid, p, greedy(12)) for rid, p, _ in workload[0]]})  # fmt: skip
    engine = make_engine(
        tiny_model_dir,
        speculative_method="draft",
        draft_model=tiny_draft_model_dir,
        speculative_disable_batch_size=64,
        max_num_batched_tokens=16,
    )
    forward = engine.proposer.runner.forward
    fed: list[int] = []

    def counting_forward(seqs):
        fed.append(sum(len(s.token_ids) for s in seqs))
        return forward(seqs)

    engine.proposer.runner.forward = counting_forward
    results = run_to_completion(engine, workload)
    assert max(fed) <= 16 and sum(fed) > 100
    for rid, ref in reference.items():
        assert results[rid]["token_ids"] == ref["token_ids"]
    assert engine.stats.num_draft_tokens > 0
    assert_all_blocks_released(engine)


@pytest.mark.parametrize("propose_s, most_steps_speculate", [(0.0, True), (0.08, False)])
def test_the_gate_keeps_speculation_only_where_the_engine_measures_it_faster(
    tiny_model_dir, monkeypatch, propose_s, most_steps_speculate
):
    """Drafts that are always accepted (the plain output itself) from a proposer that
    costs nothing, or more than the four tokens it saves: adaptive k's models price an
    n-gram draft at 1% of a step either way; the gate measures the steps and keeps
    speculating in the first case, runs plain (but for its probes) in the second. The
    output is the plain greedy output in both."""
    import time

    from engine.core.model_runner import ModelRunner
    from engine.spec_decode.proposers import NgramSpecProposer

    prompt = prompts_of_lengths([9], seed=5)[0]
    params = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
    reference = run_to_completion(make_engine(tiny_model_dir), {0: [("r", prompt, params)]})
    full = list(prompt) + reference["r"]["token_ids"]

    def oracle(self, items, states):
        time.sleep(propose_s)
        return [
            full[len(s.request.all_token_ids) : len(s.request.all_token_ids) + i.num_spec_tokens]
            for i, s in zip(items, states)
        ], None

    execute = ModelRunner.execute

    def steady_forward(self, prepared):  # a forward slow enough to time over the noise
        time.sleep(0.01)
        return execute(self, prepared)

    monkeypatch.setattr(NgramSpecProposer, "propose", oracle)
    monkeypatch.setattr(ModelRunner, "execute", steady_forward)
    engine = make_engine(tiny_model_dir, speculative_method="ngram", speculation_gate=True)
    engine.add_request("r", prompt, params)
    tokens, steps, speculating = [], 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.token_ids
        steps += 1
        speculating += bool(engine.last_step.drafts_per_verification)
    assert tokens == reference["r"]["token_ids"]
    share = speculating / steps
    gate = engine.scheduler.gate
    pays = {gate.pays(1, lane) for lane in gate.lanes()}  # n-gram's long and short lanes
    if most_steps_speculate:
        assert share > 0.8 and True in pays and False not in pays, (share, steps, pays)
    else:
        assert share < 0.45 and False in pays and True not in pays, (share, steps, pays)
        assert speculating >= 4  # it kept probing
