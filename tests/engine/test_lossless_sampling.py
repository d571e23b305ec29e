"""Sampling with speculation is lossless, tested statistically: the sequences an engine
samples follow the target's exact distribution, for every proposer alone and for the
hybrid one, whose verification batches mix n-gram rows (one-hot q) and draft-model rows
(the model's q) in one rejection-sampling call, and for token trees (suffix decoding's,
and random trees around n-gram guesses), verified by coupling with the engine's noise.

The exact distribution comes from enumeration: temperature 1 and top-k 2 over 4 tokens
is at most 16 sequences. 4000 requests each sample one; the first token comes from
prefill, the rest from verifications of up to 2 drafts. Unseeded requests are verified
by rejection sampling, seeded ones by coupling; penalties, logit bias, min_tokens and a
stop token ride along in their own rows of the matrix, and so do the .gguf's layers on
AMX tiles (this CPU's, else emulated where AVX512-BF16 runs the emulation).

Two targets: the tiny float model, against transformers' own forward, and the same
model as a .gguf served quantized (Q4_1 layers and head, Q8_0 embedding), against the
engine's plain forward of that target (rows are batch invariant, so the target a
request sees alone is the target it sees in any batch).
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

from engine.io.sampling_params import SamplingParams, StructuredOutput
from engine.loader import load_model
from engine.spec_decode.verifier import Verifier
from tests.engine.engine_helpers import _hf_model, hf_greedy, make_engine, run_to_completion
from tests.engine.penalty_reference import adjust, stop_ids_of
from tests.engine.simple_runner import SimplePagedRunner
from tests.engine.tree_helpers import install_tree_proposer
from tests.tiny_models import EOS_ID

TOP_K = 2
NUM_TOKENS = 4  # the first from prefill, then 2 drafts + a bonus in one verification
NUM_SAMPLES = 4000

# A context that repeats itself, so n-gram lookup drafts, and drafts tokens of the
# target's top 2 often enough that they are both accepted and rejected, with and without
# PENALIZED's features (found by a search over periodic prompts on the tiny model: most
# give n-gram drafts of probability 0, which only ever test rejection).
PROMPT = [20, 49, 20, 49, 20, 49]

# name -> (speculative_method, which draft: the target cut to one layer, or made by
# `specserve train-draft`, layers or EAGLE). "hybrid" mixes n-gram and draft-model rows in
# one batch; "hybrid-eagle" n-gram and EAGLE rows.
PROPOSERS = {
    "ngram": ("ngram", None),
    "draft": ("draft", "truncated"),
    "trained": ("draft", "trained"),
    "hybrid": ("hybrid", "trained"),
    "eagle": ("eagle", "eagle"),
    "hybrid-eagle": ("hybrid", "eagle"),
    # token trees, verified by coupling whatever the request: suffix decoding's, and
    # random trees around n-gram lookup's guess (tests/engine/tree_helpers.py)
    "suffix": ("suffix", None),
    "random-trees": ("ngram", None),
    # EAGLE's dynamic trees: the draft's best guesses, several per position
    "eagle-tree": ("eagle-tree", "eagle"),
    # n-gram lookup's last matches merged into a tree
    "ngram-tree": ("ngram-tree", None),
}

# 16 outcomes, 4000 samples: a correct sampler's TV distance is about 0.02-0.03; a
# sampler that skips the residual lands at 0.07-0.08.
ENGINE_TV_BOUND = 0.06

# Two tokens favoured by a bias, penalties that make repeats less likely, and a stop
# token that may end a sequence only from its third token on: verification rows must
# count the drafts before them and judge min_tokens at their own position.
PENALIZED = {
    "frequency_penalty": 0.3,
    "presence_penalty": 0.3,
    "repetition_penalty": 1.1,
    "logit_bias": {49: 1.5, 218: 1.5},
    "min_tokens": 2,
    "stop_token_ids": [218],
}


def exact_distribution(
    model_dir, prompt, features=None, dtype=torch.float32, allowed=None, kv_dtype=None
):
    """P(t1 .. t4) of the target with temperature 1 and top-k 2, by enumeration. With
    ``features`` (penalties, logit_bias, min_tokens, stop_token_ids) the reference
    applies them at each step first, and a stop token ends a sequence early; with
    ``allowed`` (seq -> the token ids a constraint allows next) it masks the rest after
    them. A .gguf target's logits come from the engine's own forward of it, anything
    else's from transformers (with ``kv_dtype``, a KV cache of another dtype than the
    model's: from the engine's forward too)."""
    next_logits = _next_logits(model_dir, prompt, dtype, kv_dtype)
    params = SamplingParams(ignore_eos=True, **(features or {}))
    stop_ids = stop_ids_of(params, {EOS_ID})

    def next_probs(seq):
        logits = adjust(next_logits(seq), prompt, seq, params, stop_ids)
        if allowed is not None:
            keep = torch.zeros_like(logits, dtype=torch.bool)
            keep[list(allowed(seq))] = True
            logits = logits.masked_fill(~keep, float("-inf"))
        top = logits.topk(TOP_K)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()))

    exact = {(): 1.0}
    for _ in range(NUM_TOKENS):
        longer = {}
        for seq, p in exact.items():
            if seq and seq[-1] in stop_ids:
                longer[seq] = p
                continue
            for t, q in next_probs(list(seq)).items():
                longer[seq + (t,)] = p * q
        exact = longer
    return exact


def _next_logits(model_dir, prompt, dtype, kv_dtype=None):
    """seq -> the target's raw logits [vocab] after prompt + seq."""
    if str(model_dir).endswith(".gguf") or kv_dtype is not None:
        model = load_model(model_dir, device="cpu", dtype=str(dtype).removeprefix("torch.")).model
        runner = SimplePagedRunner(model, num_blocks=64, kv_dtype=kv_dtype)
        count = iter(range(10**6))

        def from_engine(seq):
            seq_id = next(count)
            runner.add_sequence(seq_id)
            logits = runner.step([(seq_id, prompt + seq)])[0].float()
            runner.free_sequence(seq_id)
            return logits

        return from_engine
    model = _hf_model(model_dir, dtype)

    def from_transformers(seq):
        with torch.no_grad():
            return model(torch.tensor([prompt + seq])).logits[0, -1].float()

    return from_transformers


def tv(samples, exact) -> float:
    counts: dict[tuple, int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    return tv_exact({s: c / len(samples) for s, c in counts.items()}, exact)


def tv_exact(p, q) -> float:
    return 0.5 * sum(abs(p.get(s, 0.0) - q.get(s, 0.0)) for s in set(p) | set(q))


class _SourceCounter:
    """Wraps a verifier: per call, whether its drafts came from n-gram lookup (no q),
    the draft model (q), or both."""

    def __init__(self, verify) -> None:
        self.verify = verify
        self.ngram_steps = self.model_steps = self.mixed_steps = self.tree_steps = 0

    def __call__(self, logits, sched, states, drafts, draft_probs, masks=None, parents=None):
        items = [s for s in sched.scheduled if s.needs_sample]
        drafted = [item.request_id for item, d in zip(items, drafts) if d]
        ngram = any(r not in draft_probs for r in drafted)
        model = any(r in draft_probs for r in drafted)
        self.ngram_steps += ngram
        self.model_steps += model
        self.mixed_steps += ngram and model
        self.tree_steps += any(p is not None for p in parents or ())
        return self.verify(logits, sched, states, drafts, draft_probs, masks, parents)


def sample_sequences(
    model_dir,
    draft_dirs,
    proposer,
    prompt=PROMPT,
    features=None,
    seeded=False,
    dtype="float32",
    constraint=None,
    kv_cache_dtype="auto",
):
    """NUM_SAMPLES sequences from one engine speculating with ``proposer`` (a PROPOSERS
    key, or "none"); checks that drafts were both accepted and rejected."""
    method, draft = PROPOSERS.get(proposer, ("none", None))
    engine = make_engine(
        model_dir,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        speculative_method=method,
        draft_model=draft_dirs[draft] if draft else None,
        speculative_disable_batch_size=4096,
        num_kv_blocks=1200,
        seed=5,
        # what is tested is the distribution, not the machine's speed: a CPU-time budget
        # could end a request on a loaded machine (grammar.GrammarLimits)
        structured_output_step_budget_ms=6e4,
    )
    if proposer == "random-trees":
        install_tree_proposer(engine, seed=5)
    counter = _SourceCounter(engine.verifier.verify)
    engine.verifier.verify = counter
    params = [
        SamplingParams(
            max_tokens=NUM_TOKENS,
            temperature=1.0,
            top_k=TOP_K,
            ignore_eos=True,
            num_speculative_tokens=2 if method != "none" else None,
            seed=1000 + i if seeded else None,
            structured_output=constraint,
            **(features or {}),
        )
        for i in range(NUM_SAMPLES)
    ]
    results = run_to_completion(engine, {0: [(f"s{i}", prompt, p) for i, p in enumerate(params)]})
    failed = [r["detail"] for r in results.values() if r["finish_reason"] == "error"]
    assert not failed, failed[:3]
    if method != "none":
        assert 0 < engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens
    if method == "hybrid":  # both sources drafted, side by side in one verification
        assert counter.mixed_steps >= 10
    # branching trees, not only chains (EAGLE's under the constraint: its refused
    # nodes are pruned, and what is left of a 2-node tree is mostly a chain)
    if proposer == "random-trees" or (proposer == "eagle-tree" and constraint is None):
        assert counter.tree_steps >= 10, counter.tree_steps
    return [tuple(r["token_ids"]) for r in results.values()]


@pytest.fixture(scope="module")
def draft_dirs(tiny_draft_model_dir, tiny_trained_draft_dir, close_eagle_targets) -> dict[str, str]:
    return {
        "truncated": tiny_draft_model_dir,
        "trained": tiny_trained_draft_dir,
        **{f"eagle:{kind}": draft for kind, (_, draft) in close_eagle_targets.items()},
    }


@pytest.fixture(scope="module")
def targets(
    tiny_model_dir, tiny_bf16_checkpoint, tiny_gguf_path, close_eagle_targets
) -> dict[str, str]:
    """The float model, the same model as a .gguf served quantized, and its bf16
    checkpoint (in float32: Linear weights stored as bf16); for the EAGLE rows a
    one-layer model (float and .gguf) whose close EAGLE draft is accepted often and
    rejected often (conftest.close_eagle_targets)."""
    eagle = {f"eagle:{kind}": target for kind, (target, _) in close_eagle_targets.items()}
    return {
        "float": tiny_model_dir, "bf16-checkpoint": tiny_bf16_checkpoint,
        "gguf": tiny_gguf_path, **eagle,
    }  # fmt: skip


def _case(targets, draft_dirs, proposer: str, target: str):
    """(the target, the drafts, the prompt) a test row runs. EAGLE rows run on the
    one-layer target, with a prompt where n-gram lookup has a 3-token match exactly when
    the first sampled token is the target's greedy choice (then the hybrid rows mix
    n-gram and EAGLE rows in one verification)."""
    if PROPOSERS.get(proposer, ("", None))[1] != "eagle":
        return targets[target], draft_dirs, PROMPT
    model = targets[f"eagle:{target}"]
    dirs = {**draft_dirs, "eagle": draft_dirs[f"eagle:{target}"]}
    return model, dirs, _eagle_prompt(targets["eagle:float"])


@functools.lru_cache(maxsize=2)
def _eagle_prompt(model_dir: str) -> list[int]:
    continuation = hf_greedy(model_dir, PROMPT[:2], 3)
    return [5, *PROMPT[:2], *continuation, 5, *PROMPT[:2]]


@pytest.mark.parametrize("target", ["float", "gguf"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("proposer", list(PROPOSERS))
def test_sampled_sequences_follow_the_target_distribution(
    targets, draft_dirs, proposer, dtype, target
):
    """Rejection sampling, every proposer. In bfloat16 against transformers' bf16 model:
    the engine's bf16 kernels round where its ops round, so the two targets differ by
    far less than the bound. The trained draft's head scores 200 of the 259 tokens;
    the others can only come from the residual distribution."""
    model, dirs, prompt = _case(targets, draft_dirs, proposer, target)
    exact = exact_distribution(model, prompt, dtype=getattr(torch, dtype))
    samples = sample_sequences(model, dirs, proposer, prompt, dtype=dtype)
    assert set(samples) <= set(exact)
    assert tv(samples, exact) < ENGINE_TV_BOUND


@pytest.mark.parametrize("target", ["float", "gguf"])
@pytest.mark.parametrize("proposer", ["none", *PROPOSERS])
def test_seeded_samples_follow_the_target_distribution(targets, draft_dirs, proposer, target):
    """One seed per request: the outcomes over many seeds are exact target samples
    (coupled verification keeps the distribution, like rejection sampling does)."""
    model, dirs, prompt = _case(targets, draft_dirs, proposer, target)
    exact = exact_distribution(model, prompt)
    samples = sample_sequences(model, dirs, proposer, prompt, seeded=True)
    assert set(samples) <= set(exact)
    assert tv(samples, exact) < ENGINE_TV_BOUND


@pytest.mark.parametrize(
    "proposer", ["none", *(p for p, (_, draft) in PROPOSERS.items() if draft != "eagle")]
)
@pytest.mark.parametrize("seeded", [False, True], ids=["rejection", "coupling"])
def test_a_bf16_checkpoint_in_float32_follows_its_distribution(
    targets, draft_dirs, proposer, seeded
):
    """Served in float32, a bf16 checkpoint's Linear weights stay bf16 and are widened
    in the kernel (issue 35): rejection sampling and coupling, every proposer but
    EAGLE's (its rows run on their own one-layer targets, above), against transformers'
    float32 model of the checkpoint."""
    model, dirs, prompt = _case(targets, draft_dirs, proposer, "bf16-checkpoint")
    exact = exact_distribution(model, prompt)
    samples = sample_sequences(model, dirs, proposer, prompt, seeded=seeded)
    assert set(samples) <= set(exact)
    assert tv(samples, exact) < ENGINE_TV_BOUND


@pytest.mark.parametrize(
    ("proposer", "target", "seeded"),
    [
        ("none", "float", False),
        ("hybrid", "float", True),
        ("ngram", "float", False),
        ("draft", "gguf", True),
        ("eagle-tree", "gguf", False),
        ("random-trees", "gguf", True),
    ],
)
def test_a_bf16_kv_cache_follows_its_own_distribution(
    targets, draft_dirs, proposer, target, seeded
):
    """--kv-cache-dtype bfloat16 on a float32 target: speculation stays lossless against
    the target as served, whose keys and values are rounded to bf16 (its distribution
    from the engine's own forward over a bf16 cache); chains, mixed batches and trees,
    rejection and coupling."""
    model, dirs, prompt = _case(targets, draft_dirs, proposer, target)
    exact = exact_distribution(model, prompt, kv_dtype=torch.bfloat16)
    samples = sample_sequences(
        model, dirs, proposer, prompt, seeded=seeded, kv_cache_dtype="bfloat16"
    )
    assert set(samples) <= set(exact)
    assert tv(samples, exact) < ENGINE_TV_BOUND


@pytest.mark.parametrize(
    ("proposer", "dtype", "seeded"),
    [
        ("hybrid", "float32", False),
        ("random-trees", "float32", True),
        ("draft", "bfloat16", False),
    ],
)
def test_quantized_layers_on_amx_tiles_follow_the_target_distribution(
    on_amx_tiles, targets, draft_dirs, proposer, dtype, seeded
):
    """The .gguf's quantized Linear layers on AMX tiles (every row block, even a lone
    decode row: the rule 1; this CPU's tiles, else emulated): the target is the same
    bits as on vpdpbusd, so speculation stays lossless; chains, mixed batches and
    trees, rejection and coupling, fp32 and bf16."""
    from engine.kernels.quant import quant_ops

    ops = quant_ops()
    if ops is None or ops.amx_min_rows == 0:
        pytest.skip("no AMX-INT8 path in these kernels (the quantized Linear off zmm)")
    rule = (lambda: ops.amx_min_rows, ops.set_amx_min_rows, lambda: ops.amx_calls)
    exact, samples = _on_tiles(rule, targets, draft_dirs, proposer, dtype, seeded)
    assert set(samples) <= set(exact)
    assert tv(samples, exact) < ENGINE_TV_BOUND


def _on_tiles(rule, targets, draft_dirs, proposer, dtype, seeded):
    """The .gguf target's exact distribution and the engine's samples with a kernel
    rule (its getter, setter and calls counter) at 1, every call on the tiles; then the
    rule as it was, and a check that calls ran on them."""
    get, set_rule, calls = rule
    before, count = get(), calls()
    set_rule(1)
    try:
        model, dirs, prompt = _case(targets, draft_dirs, proposer, "gguf")
        exact = exact_distribution(model, prompt, dtype=getattr(torch, dtype))
        samples = sample_sequences(model, dirs, proposer, prompt, seeded=seeded, dtype=dtype)
    finally:
        set_rule(before)
    assert calls() > count, "no call ran on the tiles"
    return exact, samples


@pytest.mark.parametrize(
    ("proposer", "dtype", "seeded"),
    [
        # every proposer alone, chains under rejection and trees under coupling
        *(
            (p, "float32", p in ("draft", "suffix", "random-trees"))
            for p in ["none", *PROPOSERS]
            if p != "hybrid"
        ),
        ("hybrid", "float32", False),  # n-gram and draft-model rows in one verification
    ],
)
def test_quantized_layers_on_bf16_tiles_follow_the_target_distribution(
    on_amx_tiles, targets, draft_dirs, proposer, dtype, seeded, monkeypatch
):
    """The .gguf's quantized Linear layers dequantized to bf16 on AMX-BF16 tiles (the
    ``--no-batch-invariance`` path) at every row count (rule 1: batch invariant again,
    so the target is one distribution): speculation is lossless against it; no
    speculation, every proposer alone (chains under rejection, token trees under
    coupling, seeded and not) and mixed in one verification. In float32: in bf16
    the tiny target's first logits on this path tie for second place (1.96875 twice),
    which top-k 2 cannot split the way the enumeration does (bf16 greedy exactness on
    the path is the stress test's seed 9)."""
    from engine.core import llm_engine
    from engine.kernels.quant import quant_ops

    ops = quant_ops()
    if ops is None or not ops.bf16_tiles:
        pytest.skip("no bf16 tile path for the quantized Linear in these kernels")
    monkeypatch.setattr(llm_engine, "_apply_batch_invariance", lambda invariant: None)
    rule = (lambda: ops.bf16_min_rows, ops.set_bf16_min_rows, lambda: ops.bf16_calls)
    exact, samples = _on_tiles(rule, targets, draft_dirs, proposer, dtype, seeded)
    assert set(samples) <= set(exact)
    assert tv(samples, exact) < ENGINE_TV_BOUND


@pytest.mark.parametrize(
    ("proposer", "target"),
    [
        ("ngram", "float"),
        ("draft", "float"),
        ("hybrid", "float"),
        ("hybrid", "gguf"),
        ("eagle", "float"),
        ("hybrid-eagle", "gguf"),
        ("random-trees", "float"),
        ("suffix", "gguf"),
    ],  # fmt: skip
)
@pytest.mark.parametrize("seeded", [False, True], ids=["rejection", "coupling"])
def test_penalized_sampled_sequences_follow_the_penalized_distribution(
    targets, draft_dirs, proposer, seeded, target
):
    """Exact samples of the target under penalties applied at each step, verified by
    rejection sampling (unseeded) or coupling (seeded)."""
    model, dirs, prompt = _case(targets, draft_dirs, proposer, target)
    exact = exact_distribution(model, prompt, PENALIZED)
    # Far from the plain distribution (0.36), so a verifier that dropped the features
    # would fail the bound below.
    assert tv_exact(exact, exact_distribution(model, prompt)) > 5 * ENGINE_TV_BOUND
    samples = sample_sequences(model, dirs, proposer, prompt, PENALIZED, seeded=seeded)
    assert set(samples) <= set(exact)
    assert tv(samples, exact) < ENGINE_TV_BOUND


# A constraint over the tiny byte-level vocabulary: 4 letters or digits. PROMPT's tokens
# ('2' and 'O') are among them, so n-gram drafts stay inside it; the model's favourite
# tokens often are not, so the mask moves the distribution far (checked below).
CONSTRAINT = StructuredOutput(regex="[0-9A-Za-z]{4}")


def _constraint_allows(tokenizer):
    """The reference mask, independent of llguidance: the characters of the class."""
    letters = [
        t for t in range(tokenizer.vocab_size) if re.fullmatch("[0-9A-Za-z]", tokenizer.decode([t]))
    ]
    return lambda seq: letters if len(seq) < 4 else []


@pytest.mark.parametrize("proposer", ["none", *PROPOSERS])
@pytest.mark.parametrize("seeded", [False, True], ids=["rejection", "coupling"])
def test_constrained_sampled_sequences_follow_the_masked_distribution(
    targets, draft_dirs, proposer, seeded
):
    """Under a structured-output constraint the target is the model's distribution
    masked to what the constraint allows and renormalized: every proposer, mixed in one
    batch (hybrid), rejection sampling and coupling."""
    from tests.tiny_models import make_tokenizer

    model, dirs, prompt = _case(targets, draft_dirs, proposer, "float")
    allows = _constraint_allows(make_tokenizer())
    exact = exact_distribution(model, prompt, allowed=allows)
    assert tv_exact(exact, exact_distribution(model, prompt)) > 5 * ENGINE_TV_BOUND
    samples = sample_sequences(model, dirs, proposer, prompt, seeded=seeded, constraint=CONSTRAINT)
    assert set(samples) <= set(exact)
    assert tv(samples, exact) < ENGINE_TV_BOUND


# ---- the checks have the power to catch the bugs they are there for ---------------------


def test_the_check_catches_a_sampler_that_skips_the_residual(
    tiny_model_dir, draft_dirs, monkeypatch
):
    from tests.engine.test_rejection_sampler import _skip_residual

    monkeypatch.setattr("engine.spec_decode.verifier.rejection_sample", _skip_residual)
    exact = exact_distribution(tiny_model_dir, PROMPT)
    samples = sample_sequences(tiny_model_dir, draft_dirs, "draft")
    assert tv(samples, exact) > ENGINE_TV_BOUND


def _zero_q_for_ngram_rows(self, raced, items, drafts, draft_probs, k_max, vocab_size):
    """Issue 24's bug: in a batch with draft-model rows, n-gram rows left at q = 0."""
    q = torch.zeros((len(raced), k_max, vocab_size), device=self.device)
    for row, i in enumerate(raced):
        rows = draft_probs.get(items[i].request_id)
        if rows is not None:
            q[row, : rows.shape[0]] = rows
    return q


def test_the_check_catches_ngram_rows_without_their_one_hot_q(
    tiny_model_dir, draft_dirs, monkeypatch
):
    monkeypatch.setattr(Verifier, "_draft_distributions", _zero_q_for_ngram_rows)
    exact = exact_distribution(tiny_model_dir, PROMPT)
    samples = sample_sequences(tiny_model_dir, draft_dirs, "hybrid")
    assert tv(samples, exact) > ENGINE_TV_BOUND
