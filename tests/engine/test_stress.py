"""Randomized engine stress: draft, EAGLE, n-gram and token-tree speculation (suffix
decoding's trees, EAGLE's dynamic trees, n-gram lookup's trees, random trees) x
preemption x chunked prefill x prefix hits x stop strings x aborts x greedy, seeded and
unseeded rows x per-request k x penalties, logit bias, min_tokens,
include_stop_str_in_output, truncate_prompt_tokens x structured-output constraints (one
that fails mid-output among them) x a model whose logits turn NaN for a request from
some output token on x a float target (its checkpoint in fp32, or in bf16: in float32
its Linear weights stored as bf16) or a quantized one (the tiny model as a .gguf served
as stored) x the speculation gate on or off (its lanes choosing k by timing) x a KV
cache in the model's dtype or, for half the float32 seeds, in bf16; odd seeds
in bfloat16, each on one of the bf16 Linear kernels this CPU has (AMX tiles, vdpbf16ps,
FMA), seeds 1, 5, 9, ... on kernels with AMX (this CPU's tiles, else the emulated AMX
level), seeds 1, 9, 17, ... with every quantized call on bf16 tiles; even seeds in
float32, each on the native build or one of the prebuilt kernel levels this CPU
executes (the AVX2 one among them) x, where the kernels have the quantized Linear's AMX
path, its rule (as shipped, every row block on tiles, or from 16 rows), so the .gguf's
layers run on tiles, in the team and out of it.

Every step: both pools pass check_integrity and no request holds a block beyond its KV
length (check_pools); the draft cache never covers a request's last verified token.
At the end: every pool is empty, every request ended exactly once, and every greedy or
seeded request that was not aborted reported exactly what it reports alone in a plain
engine (no speculation, no preemption, no chunking, every constrained row masked): token
ids, text, finish reason. A request whose constraint fails ends with "error" and a
prefix of the plain engine's output (speculation may meet the failure in a draft,
before the output reaches it). A request whose logits turned NaN ends with "error" at
the first step that began past its poisoned token, its output the plain engine's cut
there; one that ended before that step is unaffected.

A few seeds run in CI; ``pytest tests/engine/test_stress.py --stress-seeds 300`` runs
many more.
"""

from __future__ import annotations

import random
from dataclasses import replace

from engine.core import llm_engine as llm_engine_mod
from engine.io.sampling_params import SamplingParams, StructuredOutput
from engine.kernels import cpu as cpu_mod
from engine.kernels import quant as quant_mod
from tests.engine.engine_helpers import (
    LogitPoison,
    assert_all_blocks_released,
    check_pools,
    draft_proposer,
    make_engine,
)
from tests.engine.kernel_levels import amx_kernels, kernels_of, runnable_levels, use_kernels
from tests.engine.tree_helpers import install_tree_proposer


def pytest_generate_tests(metafunc):
    if "stress_seed" in metafunc.fixturenames:
        num_seeds = metafunc.config.getoption("--stress-seeds")
        metafunc.parametrize("stress_seed", range(num_seeds))


def _stops(rng: random.Random) -> list[str]:
    # Byte-level tiny tokenizer: one printable ASCII character is one token.
    return rng.sample("abcdefghijklmnopqrstuvwxyz0123456789 .,!?", rng.randint(1, 3))


def _params(rng: random.Random, max_k: int) -> tuple[str, SamplingParams]:
    kind = rng.choice(["greedy", "seeded", "seeded", "unseeded"])
    kw: dict = {"max_tokens": rng.randint(1, 28), "ignore_eos": rng.random() < 0.7}
    if kind == "greedy":
        kw["temperature"] = 0.0
    else:
        kw["temperature"] = rng.choice([0.05, 0.3, 0.8, 1.3])
        kw["top_p"] = rng.choice([1.0, 0.9])
        kw["top_k"] = rng.choice([0, 0, 20])
        kw["min_p"] = rng.choice([0.0, 0.0, 0.05])
    if kind == "seeded":
        kw["seed"] = rng.randrange(2**32)
    if rng.random() < 0.4:
        kw["stop"] = _stops(rng)
    if rng.random() < 0.2:
        kw["logprobs"] = rng.randint(0, 3)
    kw["num_speculative_tokens"] = rng.choice([None, None, 0, rng.randint(1, max_k)])
    if rng.random() < 0.4:
        kw.update(_logit_features(rng, kw["max_tokens"]))
    if rng.random() < 0.3:
        kw["structured_output"] = rng.choice(CONSTRAINTS)
    elif rng.random() < 0.05:  # the parser gives up at output token 15, if it gets there
        kw["structured_output"] = FAILING
        kw["max_tokens"] = kw["min_tokens"] = rng.randint(12, 24)
    return kind, SamplingParams(**kw)


# Structured output in the mix: forced runs, free runs, dead ends (beside min_tokens)
# and constraints that max_tokens cuts short.
CONSTRAINTS = [
    StructuredOutput(regex="[a-z ]{3,40}\\."),
    StructuredOutput(choice=("yes", "no", "maybe so")),
    StructuredOutput(json_schema={"type": "object", "properties": {"ok": {"type": "boolean"}}}),
    StructuredOutput(grammar='start: "id-" /[0-9]{2,6}/'),
]


# Forty alternatives that each match every string of a-l: llguidance's parser passes
# its limit of 2000 items a row at output token 15, whatever the letters.
FAILING = StructuredOutput(
    grammar="start: s\ns: "
    + " | ".join(f"s{i}" for i in range(40))
    + "\n"
    + "".join(f"s{i}: s s | /[a-l]/\n" for i in range(40))
)


def _logit_features(rng: random.Random, max_tokens: int) -> dict:
    """Some of penalties, logit bias, min_tokens (with stop token ids), keeping the stop
    string in the output, prompt truncation."""
    choices = {
        "frequency_penalty": lambda: rng.choice([-1.0, 0.5, 1.5]),
        "presence_penalty": lambda: rng.choice([-0.5, 0.8, 2.0]),
        "repetition_penalty": lambda: rng.choice([0.8, 1.2, 1.7]),
        "logit_bias": lambda: {
            rng.randrange(3, 259): rng.choice([-100.0, -2.0, 3.0, 8.0])
            for _ in range(rng.randint(1, 4))
        },
        "min_tokens": lambda: rng.randint(1, max_tokens),
        "stop_token_ids": lambda: [rng.randrange(3, 259) for _ in range(rng.randint(1, 3))],
        "include_stop_str_in_output": lambda: True,
        "truncate_prompt_tokens": lambda: rng.randint(1, 40),
    }
    names = rng.sample(sorted(choices), rng.randint(1, 4))
    return {name: choices[name]() for name in names}


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    shared = [rng.randrange(3, 200) for _ in range(rng.choice([16, 20, 33]))]
    prompts = []
    for _ in range(n):
        shape = rng.random()
        if shape < 0.3:  # prefix hits
            tail = [rng.randrange(3, 200) for _ in range(rng.randint(1, 12))]
            prompts.append(shared + tail)
        elif shape < 0.5:  # repetitive: n-gram drafts get accepted
            prompts.append([rng.randrange(3, 200) for _ in range(rng.randint(2, 5))] * 5)
        else:
            prompts.append([rng.randrange(3, 200) for _ in range(rng.randint(1, 60))])
    return prompts


def _workload(rng: random.Random, max_k: int):
    """(arrivals: step -> [(id, prompt, params, kind)], aborts: step -> [id])"""
    n = rng.randint(6, 14)
    arrivals: dict[int, list] = {}
    aborts: dict[int, list] = {}
    for i, prompt in enumerate(_prompts(rng, n)):
        kind, params = _params(rng, max_k)
        at = rng.choice([0, 0, rng.randint(0, 25)])
        arrivals.setdefault(at, []).append((f"r{i}", prompt, params, kind))
        if rng.random() < 0.2:
            aborts.setdefault(at + rng.randint(0, 12), []).append(f"r{i}")
    return arrivals, aborts


def _engine_config(rng: random.Random, draft_dirs: dict[str, str]) -> dict:
    method = rng.choice(
        ["ngram", "draft", "hybrid", "eagle", "suffix", "random-trees", "eagle-tree", "ngram-tree"]
    )
    config = dict(
        speculative_method="ngram" if method == "random-trees" else method,
        num_speculative_tokens=rng.randint(1, 5),
        spec_tree_max_nodes=rng.choice([3, 12, 40]),
        speculative_disable_batch_size=rng.choice([2, 64]),
        num_kv_blocks=rng.choice([12, 16, 24, 64]),  # small pools preempt
        max_num_batched_tokens=rng.choice([16, 24, 64, 2048]),  # small budgets chunk
        max_num_seqs=rng.choice([3, 8, 256]),
        seed=rng.randrange(1000),
        # the parser's own limit ends FAILING at a fixed position; a budget would at a
        # position that depends on the machine's speed
        structured_output_step_budget_ms=6e4,
    )
    draft = "eagle" if method == "eagle-tree" else method
    if method == "hybrid" and rng.random() < 0.5:
        draft = "eagle"  # n-gram rows beside EAGLE rows
    if draft in draft_dirs:
        config["draft_model"] = draft_dirs[draft]
    # half the seeds with the speculation gate and its lanes: k then depends on timing,
    # and greedy and seeded output must not
    config["speculation_gate"] = config["seed"] % 2 == 0
    config["random_trees"] = method == "random-trees"
    return config


def _check_draft_cache(engine) -> None:
    proposer = draft_proposer(engine)
    kv = getattr(proposer, "kv", None)
    if kv is None:
        return
    for dreq in proposer._requests.values():
        assert dreq.num_computed_tokens < dreq.num_tokens, dreq.request_id


def _run(engine, arrivals, aborts) -> dict[str, dict]:
    results: dict[str, dict] = {}
    pending = dict(arrivals)
    for step in range(5000):
        for request_id, prompt, params, _kind in pending.pop(step, []):
            engine.add_request(request_id, prompt, params)
        outputs = engine.step()
        for request_id in aborts.get(step, []):
            aborted = engine.abort_request(request_id)
            if aborted is not None:
                outputs.append(aborted)
        for out in outputs:
            r = results.setdefault(out.request_id, {"token_ids": [], "text": "", "ends": 0})
            assert r["ends"] == 0, f"{out.request_id} produced output after it finished"
            r["token_ids"] += out.token_ids
            r["text"] += out.text
            if out.finished:
                r["ends"] += 1
                r["finish_reason"] = out.finish_reason
                r["detail"] = out.finish_detail
        check_pools(engine)
        _check_draft_cache(engine)
        if not pending and not engine.has_unfinished_requests():
            return results
    raise AssertionError("the engine did not finish its work in 5000 steps")


def test_randomized_engine_stress(
    tiny_model_dir,
    tiny_bf16_checkpoint,
    tiny_gguf_path,
    spec_draft_dirs,
    close_eagle_targets,
    stress_seed,
    monkeypatch,
    request,
):
    rng = random.Random(stress_seed)
    config = _engine_config(rng, spec_draft_dirs)
    target = rng.choice([tiny_model_dir, tiny_gguf_path])
    if config.get("draft_model") == spec_draft_dirs["eagle"] and rng.random() < 0.5:
        # an EAGLE draft that is mostly accepted: full accepts, rollbacks of accepted
        # drafts and their catch-up at every block boundary
        kind = "float" if target == tiny_model_dir else "gguf"
        target, config["draft_model"] = close_eagle_targets[kind]
    if target == tiny_model_dir and random.Random(2 * 10**6 + stress_seed).random() < 0.5:
        target = tiny_bf16_checkpoint  # in float32: Linear weights stored as bf16
    arrivals, aborts = _workload(rng, config["num_speculative_tokens"])
    # odd seeds in bfloat16: greedy and seeded output must not depend on the batch there
    # either (one attention kernel for every query row, batch-invariant GEMMs)
    config["dtype"] = "bfloat16" if stress_seed % 2 else "float32"
    # float32 seeds cycle through the native build and every prebuilt kernel level this
    # CPU executes, least capable first (the portable, AVX2 and AVX-VNNI levels in the
    # few seeds CI runs: the AVX2 one's quantized Linear adds int16 sums), engine and
    # reference alike
    others = [lv for lv in runnable_levels() if lv != "native"]  # (AMX ones: below)
    levels = ["native", *reversed(others)]
    level = levels[(stress_seed // 2) % len(levels)]
    if config["dtype"] == "float32" and level != "native":
        use_kernels(monkeypatch, kernels_of(request, level))
    if stress_seed % 4 == 1:
        # seeds 1, 5, 9, ... (bf16) on kernels whose AMX paths run: this CPU's tiles,
        # else the emulated AMX level (kernel_levels.py), engine and reference alike
        tiles = amx_kernels(request)
        if tiles is not None:
            use_kernels(monkeypatch, tiles)
    # half the float32 seeds over a bf16 KV cache (--kv-cache-dtype bfloat16), engine
    # and reference alike: seeds 4 and 6 of CI's 8 (0 and 2 keep the fp32 cache)
    kv = "bfloat16" if config["dtype"] == "float32" and (stress_seed // 4) % 2 else "auto"
    config["kv_cache_dtype"] = kv
    ops = quant_mod.quant_ops()  # the kernels this seed's engine and reference use
    if ops is not None and ops.amx_min_rows != 0:
        # the quantized Linear's AMX rule by seed, engine and reference alike: as shipped
        # (Q4 never), every row block on tiles (even a lone decode row), or from 16 rows
        rule = random.Random(4 * 10**6 + stress_seed).choice([-1, 1, 16])
        before_rule = ops.amx_min_rows
        ops.set_amx_min_rows(rule)
        request.addfinalizer(lambda: ops.set_amx_min_rows(before_rule))
    if ops is not None and stress_seed % 8 == 1:
        # an eighth of the seeds (bf16 ones on the AMX kernels above; of CI's ten, seed 9
        # has the .gguf target) with every quantized Linear call on bf16 tiles (the
        # --no-batch-invariance path, at every row count: batch invariant again),
        # engine and reference alike; the engines keep the rule their config would reset
        before_bf16 = ops.bf16_min_rows
        ops.set_bf16_min_rows(1)
        request.addfinalizer(lambda: ops.set_bf16_min_rows(before_bf16))
        monkeypatch.setattr(llm_engine_mod, "_apply_batch_invariance", lambda invariant: None)
    kernels = cpu_mod.cpu_kernels()  # the seed's kernels (use_kernels patches cpu_mod's)
    if config["dtype"] == "bfloat16" and kernels is not None and kernels.bf16_linear_modes:
        # each bf16 Linear kernel this CPU has (AMX tiles, vdpbf16ps, FMA), by seed, for
        # the stressed engine and its reference alike (a rng of its own)
        mode = random.Random(3 * 10**6 + stress_seed).choice(kernels.bf16_linear_modes)
        if stress_seed % 4 == 1 and "amx" in kernels.bf16_linear_modes:
            mode = "amx"  # the AMX kernels' seeds: their tiles, for float targets too
        before = kernels.set_bf16_linear(mode)
        request.addfinalizer(lambda: kernels.set_bf16_linear(before))
    random_trees = config.pop("random_trees", False)
    engine = make_engine(target, **config)
    if random_trees:
        install_tree_proposer(engine, seed=stress_seed)
    # Some requests' logits turn NaN once they have this many output tokens (a rng of
    # its own: the workloads of the seeds stay what they were).
    poison_rng = random.Random(10**6 + stress_seed)
    poisoned = {
        rid: poison_rng.randint(0, 20)
        for batch in arrivals.values()
        for rid, *_ in batch
        if poison_rng.random() < 0.1
    }
    LogitPoison(
        engine,
        lambda request, drafts: (
            [0] if request.num_output_tokens >= poisoned.get(request.request_id, 10**9) else []
        ),
    )
    results = _run(engine, arrivals, aborts)
    assert_all_blocks_released(engine)

    requests = [r for batch in arrivals.values() for r in batch]
    aborted = {rid for ids in aborts.values() for rid in ids}
    for request_id, _, params, _ in requests:
        r = results[request_id]
        assert r["ends"] == 1, request_id
        if r["finish_reason"] == "length":
            assert len(r["token_ids"]) == params.max_tokens, request_id
        assert r["finish_reason"] in ("stop", "length", "abort", "error"), request_id
        failing = params.structured_output == FAILING
        if r["finish_reason"] == "error" and request_id in poisoned and "finite" in r["detail"]:
            assert len(r["token_ids"]) >= poisoned[request_id], (request_id, r["detail"])
        elif r["finish_reason"] == "error":
            assert failing and len(r["token_ids"]) <= 15, (request_id, r["detail"], params)
        elif failing and request_id not in aborted and params.max_tokens > 16:
            raise AssertionError(f"{request_id}: its constraint outlived the parser's limit")
    exact = [(rid, p, params) for rid, p, params, kind in requests
             if kind != "unseeded" and rid not in aborted]  # fmt: skip
    # The reference masks every constrained greedy row; the stressed engine only the rows
    # whose argmax the constraint refuses.
    monkeypatch.setenv("SPECSERVE_LAZY_GREEDY_MASKS", "0")
    reference = make_engine(
        target,
        num_kv_blocks=256,
        dtype=config["dtype"],
        kv_cache_dtype=kv,
        structured_output_step_budget_ms=6e4,
    )
    plain = [(rid, p, replace(params, num_speculative_tokens=None), "") for rid, p, params in exact]
    expected = _run(reference, {0: plain}, {})
    for request_id, _, _ in exact:
        got, want = results[request_id], expected[request_id]
        if got["finish_reason"] == "error" and "finite" in got["detail"]:  # poisoned
            assert want["token_ids"][: len(got["token_ids"])] == got["token_ids"]
            continue
        if got["finish_reason"] == "error":  # met in a draft perhaps: no later than plain
            assert want["finish_reason"] == "error", (stress_seed, request_id)
            assert want["token_ids"][: len(got["token_ids"])] == got["token_ids"]
            continue
        assert got["token_ids"] == want["token_ids"], (stress_seed, request_id, target, config)
        assert (got["text"], got["finish_reason"]) == (want["text"], want["finish_reason"])
