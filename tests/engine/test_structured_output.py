"""Structured output in the engine: every constraint kind holds on the tiny model's
output, speculation never changes what a constrained request gets (greedy and seeded,
every proposer, forced tokens included), a constraint's forced tokens cost one forward,
and the ends a constraint can come to are reported, not raised.

That sampled output follows the masked distribution: tests/engine/test_lossless_sampling.py.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from engine.io.sampling_params import SamplingParams, StructuredOutput
from engine.sample.grammar import ConstraintError
from tests.engine.engine_helpers import (
    assert_all_blocks_released,
    make_engine,
    prompts_of_lengths,
    run_to_completion,
)

BOOL_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json_schema": StructuredOutput(json_schema=BOOL_SCHEMA),
    "regex": StructuredOutput(regex="[a-e]{3}(x|yz)"),
    "choice": StructuredOutput(choice=("alpha", "beta", "gamma delta")),
    "lark": StructuredOutput(grammar='start: "v" NUM\nNUM: /[0-9]{2}/'),
    "gbnf": StructuredOutput(grammar='root ::= "w" [0-9] [0-9]'),
}


def _check(kind: str, text: str) -> None:
    if kind == "json_schema":
        value = json.loads(text)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool), text
        assert value["n"] in (1, 2, 3), text
    elif kind == "regex":
        assert re.fullmatch("[a-e]{3}(x|yz)", text), text
    elif kind == "choice":
        assert text in ("alpha", "beta", "gamma delta"), text
    elif kind == "lark":
        assert re.fullmatch("v[0-9]{2}", text), text
    else:
        assert re.fullmatch("w[0-9]{2}", text), text


def _params(constraint, temperature=0.0, **kw) -> SamplingParams:
    return SamplingParams(
        max_tokens=40, temperature=temperature, structured_output=constraint, **kw
    )


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_constraint_holds_and_the_request_stops_when_it_is_complete(
    tiny_model_dir, kind, temperature
):
    engine = make_engine(tiny_model_dir, seed=3)
    prompts = prompts_of_lengths([5, 17, 30], seed=4)
    params = _params(CONSTRAINTS[kind], temperature)
    results = run_to_completion(engine, {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]})
    for r in results.values():
        assert r["finish_reason"] == "stop"  # ended at EOS, the only token left
        _check(kind, r["text"])
    assert_all_blocks_released(engine)


def _workload(k, constraint=CONSTRAINTS["json_schema"], temperature=0.0, seeded=False):
    prompts = prompts_of_lengths([3, 16, 33, 9], seed=8)
    repetitive = prompts_of_lengths([5], seed=9)[0] * 6  # n-gram lookup finds drafts here
    prompts.append(repetitive)
    return {
        i: [
            (
                f"r{i}",
                p,
                SamplingParams(
                    max_tokens=40,
                    temperature=temperature,
                    seed=100 + i if seeded else None,
                    num_speculative_tokens=k,
                    structured_output=constraint,
                ),
            )
        ]
        for i, p in enumerate(prompts)
    }


@pytest.mark.parametrize("kind", ["json_schema", "regex", "lark"])
@pytest.mark.parametrize("method", ["ngram", "draft", "hybrid", "eagle"])
def test_greedy_speculation_under_a_constraint_is_the_plain_constrained_output(
    tiny_model_dir, spec_draft_dirs, method, kind
):
    constraint = CONSTRAINTS[kind]
    reference = run_to_completion(make_engine(tiny_model_dir), _workload(None, constraint))
    engine = make_engine(
        tiny_model_dir,
        speculative_method=method,
        draft_model=spec_draft_dirs.get(method),
        speculative_disable_batch_size=64,
    )
    for k in (1, 4, None):
        results = run_to_completion(engine, _workload(k, constraint))
        for rid, ref in reference.items():
            assert results[rid]["token_ids"] == ref["token_ids"], (k, rid)
            _check(kind, results[rid]["text"])
        assert_all_blocks_released(engine)


@pytest.mark.parametrize("method", ["none", "ngram", "draft", "hybrid", "eagle"])
def test_a_seeded_constrained_request_is_the_same_alone_and_in_a_crowd(
    tiny_model_dir, spec_draft_dirs, method
):
    crowd = _workload(None, temperature=0.9, seeded=True)
    alone = {}
    for arrivals in crowd.values():
        (rid, prompt, params) = arrivals[0]
        engine = make_engine(tiny_model_dir, seed=7)
        alone[rid] = run_to_completion(engine, {0: [(rid, prompt, params)]})[rid]["token_ids"]
    unconstrained = [("u", prompts_of_lengths([12], seed=1)[0], SamplingParams(max_tokens=30))]
    crowd.setdefault(1, []).extend(unconstrained)
    engine = make_engine(
        tiny_model_dir,
        speculative_method=method,
        draft_model=spec_draft_dirs.get(method),
        speculative_disable_batch_size=64,
        seed=11,
    )
    results = run_to_completion(engine, crowd)
    for rid, tokens in alone.items():
        assert results[rid]["token_ids"] == tokens, rid
    assert_all_blocks_released(engine)


def test_forced_tokens_cost_one_forward_and_change_nothing(tiny_model_dir):
    """A constraint that forces 12 tokens in a row: one verification takes them all,
    with or without a proposer; the output is the same as one token a step."""
    constraint = StructuredOutput(regex="(the quick brown)|(the quick blue)")
    params = SamplingParams(max_tokens=30, temperature=0.0, structured_output=constraint)
    prompt = prompts_of_lengths([6], seed=2)[0]
    outputs, steps = {}, {}
    for method in ("none", "ngram"):
        engine = make_engine(tiny_model_dir, speculative_method=method)
        engine.add_request("r", prompt, params)
        count, tokens = 0, []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += out.token_ids
            count += 1
        outputs[method], steps[method] = tokens, count
        assert engine.stats.num_draft_tokens == 0  # forced tokens are not drafts
    assert outputs["none"] == outputs["ngram"]
    text = make_engine(tiny_model_dir).tokenizer.decode(outputs["none"][:-1])
    assert text in ("the quick brown", "the quick blue")
    # prefill, "the quick b" forced in one step, then "r"/"l" sampled, the rest forced, EOS
    assert steps["none"] <= 6, steps


def test_a_dead_end_ends_the_request_with_a_reason_and_the_batch_runs_on(tiny_model_dir):
    """min_tokens forbids the EOS the finished constraint needs: no token is allowed;
    the request ends there with EOS and says why; its neighbour is untouched."""
    engine = make_engine(tiny_model_dir)
    dead = SamplingParams(
        max_tokens=10,
        temperature=0.0,
        min_tokens=5,
        structured_output=StructuredOutput(choice=("ab",)),
    )
    free = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompt = prompts_of_lengths([7], seed=5)[0]
    results = run_to_completion(engine, {0: [("dead", prompt, dead), ("free", prompt, free)]})
    dead_out = results["dead"]
    assert dead_out["finish_reason"] == "stop"
    assert engine.tokenizer.decode(dead_out["token_ids"][:-1]) == "ab"
    assert dead_out["token_ids"][-1] in engine.eos_token_ids
    assert "dead end" in dead_out["detail"] and "position 2" in dead_out["detail"]
    assert len(results["free"]["token_ids"]) == 10 and results["free"]["detail"] is None
    assert_all_blocks_released(engine)


def test_max_tokens_before_the_constraint_is_complete_is_length_and_says_so(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    params = SamplingParams(
        max_tokens=4, temperature=0.0, structured_output=StructuredOutput(regex="a{20}")
    )
    result = run_to_completion(engine, {0: [("r", [5, 6, 7], params)]})["r"]
    assert result["finish_reason"] == "length" and result["text"] == "aaaa"
    assert "structured output incomplete" in result["detail"]


def test_a_constraint_that_does_not_compile_is_refused_by_name_and_nothing_leaks(
    tiny_model_dir,
):
    engine = make_engine(tiny_model_dir)
    bad = [
        (StructuredOutput(regex="(a"), "structured_output.regex: .*unclosed group"),
        (StructuredOutput(json_schema={"type": "objekt"}), "json_schema: Invalid type"),
        (StructuredOutput(grammar='start: "a'), "structured_output.grammar"),
    ]
    for constraint, message in bad:
        with pytest.raises(ConstraintError, match=message):
            engine.add_request("x", [5, 6], SamplingParams(structured_output=constraint))
    assert not engine.has_unfinished_requests()
    engine.add_request("x", [5, 6], _params(CONSTRAINTS["choice"]))  # the id is free again
    run_to_completion(engine)
    assert_all_blocks_released(engine)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "must set exactly one of json_schema, regex"),
        ({"regex": "a", "choice": ["b"]}, "got regex, choice"),
        ({"json_schema": "[1]"}, "json_schema must be a JSON object"),
        ({"json_schema": "{"}, "json_schema is not JSON"),
        ({"choice": []}, "choice must hold 1 to 256 strings"),
        ({"choice": ["a", ""]}, "non-empty strings"),
        ({"regex": "a" * 70000}, "regex must be at most 65536 characters"),
    ],
)
def test_a_malformed_constraint_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutput(**fields)


def test_constraints_compose_with_stop_strings_bias_and_penalties(tiny_model_dir):
    """The documented order: bias and penalties, then the constraint's mask. A stop
    string still ends the text where it appears."""
    engine = make_engine(tiny_model_dir)
    constraint = StructuredOutput(regex="[ab]{8}")
    favour_b = engine.tokenizer.encode("b")[0]
    biased = _params(constraint, logit_bias={favour_b: 100.0})
    stopped = _params(constraint, stop=["b"], logit_bias={favour_b: 100.0})
    penalized = _params(constraint, repetition_penalty=1.5, frequency_penalty=1.0)
    results = run_to_completion(
        engine,
        {
            0: [
                ("biased", [5, 6], biased),
                ("stopped", [5, 6], stopped),
                ("penalized", [5, 6], penalized),
            ]
        },  # fmt: skip
    )
    assert results["biased"]["text"] == "b" * 8  # bias can only pick among what is allowed
    assert results["stopped"]["text"] == "" and results["stopped"]["finish_reason"] == "stop"
    assert re.fullmatch("[ab]{8}", results["penalized"]["text"])


@pytest.mark.parametrize("method", ["draft", "eagle"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_model_drafts_under_the_constraint(
    tiny_model_dir, spec_draft_dirs, method, temperature, monkeypatch
):
    """The burst masks each draft position as verification will (after the drafts
    before it), so no model draft is one the constraint refuses (unmasked, the tiny
    random drafts mostly are, and each ends its run); the output stays the plain
    constrained output (greedy) or within the constraint (sampled), no block leaks."""
    from engine.core import structured

    seen = {"drafts": 0, "refused": 0, "constrained": 0}
    constrain = structured.constrain

    def checking(sched, states, forced, draft_probs):
        for item in sched.scheduled:
            state = states.get(item.request_id)
            if state is None or state.grammar is None or item.request_id not in draft_probs:
                continue
            drafts = item.spec_token_ids
            assert len(draft_probs[item.request_id]) == len(drafts)
            seen["constrained"] += 1
            seen["drafts"] += len(drafts)
            # EOS where the constraint is complete is its only token, though a matcher
            # that stopped there validates nothing more
            body = drafts[:-1] if drafts and drafts[-1] in state.request.stop_token_ids else drafts
            seen["refused"] += len(body) - state.grammar.allowed_prefix(body)
        return constrain(sched, states, forced, draft_probs)

    monkeypatch.setattr(structured, "constrain", checking)
    # constraints with room to choose (forced tokens need no drafts)
    letters = StructuredOutput(regex="[a-z ]{12,30}\\.")
    name = StructuredOutput(
        json_schema={
            "type": "object",
            "properties": {"name": {"type": "string", "pattern": "^[a-z]{8,16}$"}},
            "required": ["name"],
            "additionalProperties": False,
        }
    )
    prompts = prompts_of_lengths([3, 16, 33, 9], seed=8)

    def workload(**kw):
        return {
            0: [
                (f"r{i}-{j}", p, _params(c, temperature, **kw))
                for i, p in enumerate(prompts)
                for j, c in enumerate((letters, name))
            ]
        }

    engine = make_engine(
        tiny_model_dir,
        speculative_method=method,
        draft_model=spec_draft_dirs[method],
        speculative_disable_batch_size=64,
    )
    results = run_to_completion(engine, workload(num_speculative_tokens=4))
    assert seen["drafts"] > 20 and seen["constrained"] > 10, seen
    assert seen["refused"] == 0, seen
    for rid, r in results.items():
        if rid.endswith("-0"):
            assert re.fullmatch("[a-z ]{12,30}\\.", r["text"]), r["text"]
        else:
            assert re.fullmatch("[a-z]{8,16}", json.loads(r["text"])["name"]), r["text"]
    if temperature == 0.0:
        reference = run_to_completion(make_engine(tiny_model_dir), workload())
        for rid, ref in reference.items():
            assert results[rid]["token_ids"] == ref["token_ids"], rid
    assert_all_blocks_released(engine)


def test_looking_past_the_end_of_a_constraint_leaves_its_matcher_where_it_was():
    """Once `[a-z ]{3,8}\\.` has its `.` the matcher stops, and takes the EOS after it
    without a record: masks() and mask_after() over drafts that end `.` EOS must roll
    back what was recorded, not one token per draft (that undid a verified letter, and
    the output ran past the 8 letters the constraint allows)."""
    from engine.sample.grammar import GrammarCompiler
    from tests.tiny_models import make_tokenizer

    tokenizer = make_tokenizer()
    eos = tokenizer.eos_token_id
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [eos])
    grammar = compiler.grammar(StructuredOutput(regex="[a-z ]{3,8}\\."))
    ids = tokenizer.encode("abcdefghij", add_special_tokens=False)
    dot = tokenizer.encode(".", add_special_tokens=False)
    grammar.advance(ids[:5])
    assert grammar.allowed_prefix(ids) == 3
    for drafts in ([ids[0], dot[0], eos], [dot[0], eos], [ids[0], ids[1], dot[0]]):
        rows = grammar.masks(drafts)
        assert rows.shape[0] == 1 + len(drafts)
        grammar.mask_after(drafts)
        grammar.forced_after(drafts)
        assert grammar.allowed_prefix(ids) == 3, drafts  # not 4: nothing was undone twice
    assert grammar.allowed_prefix([*ids[:3], dot[0], eos]) == 5


def test_a_model_draft_keeps_its_first_refused_token_and_an_ngram_draft_does_not(
    tiny_model_dir,
):
    """Rejection sampling is exact only if a refused draft drawn from q is rejected by
    verification (which then draws from the residual max(0, p - q)); cutting it would
    draw from p. An n-gram draft is deterministic: there the residual is p, so it is cut.
    The refused draft's own row gets a real mask; the row after it allows everything."""
    import torch

    from engine.core import structured
    from scheduler.output import ScheduledRequest, SchedulerOutput

    engine = make_engine(tiny_model_dir)
    tok = engine.tokenizer
    a, b, z = (tok.encode(c, add_special_tokens=False)[0] for c in "abz")
    constraint = StructuredOutput(regex="[ab]{6}")
    states, items = {}, []
    for rid in ("model", "ngram"):
        grammar = engine.grammars.grammar(constraint)
        request = SimpleNamespace(request_id=rid, num_output_tokens=0)
        states[rid] = SimpleNamespace(grammar=grammar, request=request)
        items.append(
            ScheduledRequest(rid, 3, 5, [0], True, 4, spec_token_ids=[a, b, z, a], spec_source=None)
        )
    sched = SchedulerOutput(items, num_batched_tokens=10)
    q = torch.full((4, engine.vocab_size), 1.0 / engine.vocab_size)
    draft_probs = {"model": q}
    structured.constrain(sched, states, {}, draft_probs)
    assert items[0].spec_token_ids == [a, b, z] and items[0].num_scheduled_tokens == 4
    assert draft_probs["model"].shape[0] == 3
    assert items[1].spec_token_ids == [a, b] and items[1].num_scheduled_tokens == 3
    masks = states["model"].grammar.masks([a, b, z])
    from engine.sample.grammar import allowed_tokens

    allowed = allowed_tokens(masks, engine.vocab_size)
    assert allowed.shape[0] == 4
    assert not allowed[2, z] and allowed[2, a]  # z's own row refuses it
    assert bool(allowed[3].all())  # never reached
    # masks() rolled back: the matcher still starts from the beginning
    assert states["model"].grammar.allowed_prefix([a] * 6) == 6


def test_the_c_mask_equals_the_torch_mask_on_awkward_rows():
    """The C kernel and the torch ops mask alike: vocab not a multiple of 32 or 16,
    extra mask words, strided rows, inf and NaN logits (never allowed), a row that
    allows nothing."""
    import torch

    from engine.kernels.cpu import cpu_kernels
    from engine.sample.grammar import mask_logits

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C compiler here: the torch path is the only one")
    gen = torch.Generator().manual_seed(0)
    for vocab in (1, 31, 49, 259, 1000):
        words = -(-vocab // 32) + 1  # llguidance may give a word more than needed
        base = torch.randn(6, vocab + 7, generator=gen)
        base[0, 0] = float("inf")
        base[1, -8] = float("nan")
        base[2, vocab // 2] = float("-inf")
        masks = torch.randint(-(2**31), 2**31 - 1, (6, words), dtype=torch.int32, generator=gen)
        masks[3] = 0  # nothing allowed: a dead row
        masks[4] = -1  # everything allowed
        a, b = base.clone(), base.clone()
        dead_c = kernels.mask_logits(a[:, :vocab], masks)  # rows strided by vocab + 7
        dead_t = mask_logits(b[:, :vocab], masks)
        assert torch.equal(a.isneginf(), b.isneginf()), vocab
        assert torch.equal(a[a.isfinite()], b[b.isfinite()]), vocab
        assert torch.equal(a[:, vocab:], base[:, vocab:])  # past the row: untouched
        assert dead_c == dead_t and 3 in dead_c, vocab
    with pytest.raises(ValueError, match="words must be a contiguous int32"):
        kernels.mask_logits(torch.zeros(2, 100), torch.zeros(2, 3, dtype=torch.int32))


def test_what_the_constraint_forces_after_ngram_drafts_rides_in_their_verification(
    tiny_model_dir, monkeypatch
):
    """A run of n-gram drafts ends where the constraint forces tokens (`=vvvvv;k`): they
    are appended to the drafts (lookahead slots past k), so fewer steps; the output is
    the plain constrained output, and the appended tokens are not counted as drafts."""
    from engine.core import structured

    constraint = StructuredOutput(regex="(k[a-c]{3}=vvvvv;)+")
    params = SamplingParams(max_tokens=60, temperature=0.0, structured_output=constraint)
    prompt = prompts_of_lengths([8], seed=3)[0]

    def run(method, tail_slots):
        monkeypatch.setattr(structured, "FORCED_TAIL_SLOTS", tail_slots)
        engine = make_engine(tiny_model_dir, speculative_method=method)
        engine.add_request("r", prompt, params)
        tokens, steps = [], 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += out.token_ids
            steps += 1
        stats = engine.stats
        assert stats.num_accepted_tokens <= stats.num_draft_tokens
        assert_all_blocks_released(engine)
        return tokens, steps

    plain, _ = run("none", structured.FORCED_TAIL_SLOTS)
    without, steps_without = run("ngram", 0)
    with_tail, steps_with = run("ngram", 8)
    assert plain == without == with_tail
    text = make_engine(tiny_model_dir).tokenizer.decode(plain)
    assert re.match("(k[a-c]{3}=vvvvv;){5}", text), text  # max_tokens ends it mid-way
    assert steps_with < steps_without, (steps_with, steps_without)


@pytest.mark.parametrize("method", ["none", "ngram", "draft", "hybrid", "eagle"])
def test_greedy_rows_masked_only_where_the_argmax_is_refused_change_nothing(
    tiny_model_dir, spec_draft_dirs, method, monkeypatch
):
    """The verifier masks a greedy row only when the constraint refuses its argmax: the
    tokens (and the logprobs, which stay the raw model's) are those of masking every
    row beside the forward (SPECSERVE_LAZY_GREEDY_MASKS=0), with strict and permissive
    constraints, penalties, a dead end, and both paths taken."""
    from engine.sample import grammar
    from engine.spec_decode import draft_model

    constraints = [
        CONSTRAINTS["json_schema"],
        CONSTRAINTS["lark"],
        StructuredOutput(regex="[\\s\\S]{0,30}"),  # the tiny model's argmax is mostly allowed
    ]
    prompts = prompts_of_lengths([3, 16, 33], seed=8) + [prompts_of_lengths([5], seed=9)[0] * 6]
    workload = {}
    for i, prompt in enumerate(prompts):
        for j, constraint in enumerate(constraints):
            extra = {"logprobs": 2} if j == 0 else {"presence_penalty": 0.5} if i == 1 else {}
            if i == 2 and j == 1:
                extra = {"min_tokens": 6}  # "v" and two digits, then no token: a dead end
            params = SamplingParams(
                max_tokens=30, temperature=0.0, structured_output=constraint, **extra
            )
            workload.setdefault(i, []).append((f"r{i}-{j}", prompt, params))
    counts = {"allowed": 0, "masked": 0}
    allows_after, mask_after = grammar.Grammar.allows_after, grammar.Grammar.mask_after
    drafting = []  # the draft burst masks its own rows: the verifier's are counted here

    def counting_allows(self, prefix, token):
        allowed = allows_after(self, prefix, token)
        counts["allowed"] += allowed and not drafting
        return allowed

    def counting_mask(self, prefix):
        counts["masked"] += not drafting
        return mask_after(self, prefix)

    def draft_masks(logits, rows):
        drafting.append(1)
        try:
            return grammar.mask_draft_logits(logits, rows)
        finally:
            drafting.pop()

    monkeypatch.setattr(grammar.Grammar, "allows_after", counting_allows)
    monkeypatch.setattr(grammar.Grammar, "mask_after", counting_mask)
    monkeypatch.setattr(draft_model, "mask_draft_logits", draft_masks)
    results = {}
    for lazy in ("0", "1"):
        monkeypatch.setenv("SPECSERVE_LAZY_GREEDY_MASKS", lazy)
        engine = make_engine(
            tiny_model_dir,
            speculative_method=method,
            draft_model=spec_draft_dirs.get(method),
            speculative_disable_batch_size=64,
        )
        results[lazy] = run_to_completion(engine, workload)
        assert_all_blocks_released(engine)
        if lazy == "0":
            assert counts == {"allowed": 0, "masked": 0}
    assert counts["allowed"] > 0 and counts["masked"] > 0, counts
    for rid, eager in results["0"].items():
        lazy = results["1"][rid]
        assert lazy["token_ids"] == eager["token_ids"], rid
        assert lazy["finish_reason"] == eager["finish_reason"], rid
        assert lazy["logprobs"] == eager["logprobs"], rid
    assert results["1"]["r0-0"]["logprobs"]  # asked for, and compared
    assert any(r["detail"] for r in results["1"].values())  # the dead end
