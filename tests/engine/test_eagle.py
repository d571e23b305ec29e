"""EAGLE drafts in serving: the target's features, the draft's paged cache and its
bookkeeping, checked against the contract in engine/spec_decode/eagle.py computed from
scratch (transformers' hidden states, a plain causal loop), and refusals.

Greedy exactness over every proposer (eagle alone, in hybrid with n-gram rows, chunked,
preempted) is in test_spec_decode.py / test_penalties.py (SPEC_CONFIGS), seeded in
test_seeded.py, sampled in test_lossless_sampling.py, and the randomized stress test
picks eagle too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engine.core.model_runner import ModelRunner, SeqInput
from engine.default_model import ModelLoadError
from engine.envs import overridden
from engine.io.sampling_params import SamplingParams
from engine.loader import load_model
from engine.spec_decode.eagle import EagleDraftForCausalLM, default_aux_layers
from engine.spec_decode.trained_draft import load_draft
from tests.engine.engine_helpers import (
    assert_all_blocks_released,
    greedy,
    make_engine,
    prompts_of_lengths,
    run_to_completion,
)
from tests.tiny_models import make_random_eagle_draft


@pytest.fixture(scope="module")
def four_layer_target(tiny_model_factory) -> str:
    return tiny_model_factory(num_hidden_layers=4)


@pytest.fixture(scope="module")
def random_eagle(tmp_path_factory):
    built: dict[str, str] = {}

    def factory(target: str, vocab: int | None = None) -> str:
        key = f"{target}:{vocab}"
        if key not in built:
            path = tmp_path_factory.mktemp("random-eagle")
            built[key] = make_random_eagle_draft(target, path, vocab=vocab)
        return built[key]

    return factory


def test_default_aux_layers_are_a_low_a_middle_and_a_high_layer():
    assert default_aux_layers(30) == [2, 15, 27]
    assert default_aux_layers(32) == [2, 16, 29]
    assert default_aux_layers(4) == [1, 2]
    assert default_aux_layers(2) == [0, 1]
    assert default_aux_layers(1) == [0]


# ---- the target's features ----------------------------------------------------------
def _target_features(model_dir, dtype, layers, fused: bool):
    with overridden("SPECSERVE_FUSED_DECODER", "1" if fused else "0"):
        loaded = load_model(model_dir, dtype=dtype, device="cpu")
        runner = ModelRunner(loaded, 16, 16)
    model = loaded.model.model
    seqs = [SeqInput(list(range(3, 40)), 0, [1, 2, 3], 1), SeqInput([5, 9, 11], 0, [4], 1)]
    plain = runner.forward(seqs)
    model.capture_layers = tuple(layers)
    logits = runner.forward(seqs)  # the same KV slots, written again with the same values
    return plain, logits, model.captured, model.fused is not None


@pytest.mark.parametrize("layers", [[0, 2], [1, 2], [3]])
def test_features_from_the_one_call_decoder_equal_the_layer_by_layer_ones(
    four_layer_target, layers
):
    """bf16: the one-call decoder runs in segments between the captured layers, and
    computes bit for bit what one call does; the features equal the Python path's."""
    plain, logits, fused_features, was_fused = _target_features(
        four_layer_target, "bfloat16", layers, fused=True
    )
    _, ref_logits, ref_features, ref_fused = _target_features(
        four_layer_target, "bfloat16", layers, fused=False
    )
    assert not ref_fused
    assert torch.equal(plain, logits)  # capturing changes nothing the target computes
    assert fused_features.shape == (40, len(layers) * 64)  # hidden size 64
    assert torch.equal(fused_features, ref_features)
    if was_fused:  # the kernels built with AVX512-BF16 here
        assert torch.equal(logits, ref_logits)


def test_features_are_transformers_hidden_states_entering_each_layer(four_layer_target):
    from transformers import AutoModelForCausalLM

    _, _, features, _ = _target_features(four_layer_target, "float32", [0, 2, 3], fused=False)
    hf = AutoModelForCausalLM.from_pretrained(four_layer_target, dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(torch.tensor([list(range(3, 40))]), output_hidden_states=True).hidden_states
    want = torch.cat([states[layer][0] for layer in (0, 2, 3)], dim=-1)
    torch.testing.assert_close(features[:37], want, rtol=1e-4, atol=1e-4)


# ---- the draft against the contract, computed from scratch ----------------------------
def _rope(x, positions, theta):  # x [T, heads, hd], HF's rotate-half convention
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = positions[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class _ContractDraft:
    """The contract's draft, one position at a time, in float32: the reference."""

    def __init__(self, draft_dir: str, target_dir: str):
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.w = {k: v.float() for k, v in load_file(f"{draft_dir}/model.safetensors").items()}
        self.meta = json.loads(Path(draft_dir, "draft.json").read_text())
        self.cfg = json.loads(Path(draft_dir, "config.json").read_text())
        self.hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.embed = self.hf.model.embed_tokens.weight.detach()
        head = self.hf.lm_head.weight.detach()
        self.head = head[self.w["specserve.draft_vocab"].long()]

    def features(self, tokens: list[int]) -> torch.Tensor:  # f_j [T, H]
        with torch.no_grad():
            states = self.hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        g = torch.cat([states[layer][0] for layer in self.meta["aux_layers"]], dim=-1)
        return g @ self.w["eagle.fc.weight"].t()

    def logits(self, verified: list[int], drafts: list[int]) -> torch.Tensor:
        """Draft logits over the draft vocabulary at positions M-1 .. M-1+len(drafts)
        (M = len(verified)): the distributions of d_1 .. d_{len(drafts)+1}."""
        w, cfg = self.w, self.cfg
        eps, theta = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0)
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
        f = self.features(verified)
        tokens = verified + drafts
        layer = "model.layers.0."
        keys, values, outs = [], [], []
        for j, token in enumerate(tokens):
            if j == 0:
                h = torch.zeros(cfg["hidden_size"])
            elif j - 1 < len(verified) - 1:
                h = f[j - 1]  # the target computed position j - 1
            else:
                h = outs[j - 1]  # a drafted position: the draft's own output
            e = self.embed[token]
            normed = [_rms(e, w["eagle.embed_norm.weight"], eps),
                      _rms(h, w["eagle.hidden_norm.weight"], eps)]  # fmt: skip
            u = torch.cat(normed) @ w["eagle.in_proj.weight"].t()
            x = _rms(u, w[layer + "input_layernorm.weight"], eps)

            def proj(name, x=x):
                out = x @ w[f"{layer}self_attn.{name}_proj.weight"].t()
                bias = w.get(f"{layer}self_attn.{name}_proj.bias")
                return out if bias is None else out + bias

            pos = torch.tensor([j])
            q = _rope(proj("q").view(1, heads, hd), pos, theta)[0]
            keys.append(_rope(proj("k").view(1, kv_heads, hd), pos, theta)[0])
            values.append(proj("v").view(kv_heads, hd))
            k_all = torch.stack(keys).repeat_interleave(heads // kv_heads, dim=1)
            v_all = torch.stack(values).repeat_interleave(heads // kv_heads, dim=1)
            att = torch.einsum("hd,thd->ht", q, k_all) / math.sqrt(hd)
            mixed = torch.einsum("ht,thd->hd", att.softmax(-1), v_all).reshape(-1)
            r = u + mixed @ w[layer + "self_attn.o_proj.weight"].t()
            x = _rms(r, w[layer + "post_attention_layernorm.weight"], eps)
            gate, up = (
                x @ w[layer + "mlp.gate_proj.weight"].t(),
                x @ w[layer + "mlp.up_proj.weight"].t(),
            )
            outs.append(
                r + (torch.nn.functional.silu(gate) * up) @ w[layer + "mlp.down_proj.weight"].t()
            )
        start = len(verified) - 1
        o = torch.stack(outs[start:])
        return _rms(o, w["model.norm.weight"], eps) @ self.head.t()


def _recording_eagle_engine(model_dir: str, draft_dir: str):
    """(an EAGLE engine whose proposals are recorded in ``seen`` as (request id, verified
    tokens, drafts, q), the contract's reference draft, seen)."""
    engine = make_engine(
        model_dir, speculative_method="eagle", draft_model=draft_dir,
        speculative_disable_batch_size=64,
    )  # fmt: skip
    seen = []
    propose = engine.proposer.propose

    def recording(items, states):
        verified = [list(s.request.all_token_ids) for s in states]
        drafts, probs = propose(items, states)
        seen.extend(zip([s.request.request_id for s in states], verified, drafts, probs))
        return drafts, probs

    engine.proposer.propose = recording
    return engine, _ContractDraft(draft_dir, model_dir), seen


@pytest.mark.parametrize("target", ["two_layers", "four_layers", "qwen2_tied", "mistral"])
def test_every_draft_distribution_is_the_contracts(
    target, tiny_model_dir, four_layer_target, tiny_model_factory, random_eagle
):
    """Seeded requests at temperature 1 (q is the softmax of the draft's logits), bursts
    of 4 over prefills, catch-ups after rejections and full accepts: every q row the
    proposer hands to verification is the contract's distribution, computed from
    scratch from the verified tokens and the drafts before it."""
    model_dir = {
        "two_layers": tiny_model_dir,
        "four_layers": four_layer_target,
        "qwen2_tied": tiny_model_factory(arch="qwen2", tie_word_embeddings=True),
        "mistral": tiny_model_factory(arch="mistral"),
    }[target]
    engine, reference, seen = _recording_eagle_engine(model_dir, random_eagle(model_dir, vocab=200))
    vocab = torch.tensor(json.loads(json.dumps(list(range(200)))))
    prompts = prompts_of_lengths([5, 17, 33], seed=3)
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True,
                            num_speculative_tokens=4)  # fmt: skip
    run_to_completion(engine, {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]})
    assert_all_blocks_released(engine)
    assert len(seen) >= 10 and sum(len(d) == 4 for _, _, d, _ in seen) >= 6
    for _, verified, drafts, q in seen:
        assert q is not None and 1 <= len(drafts) == len(q) <= 4  # fewer near max_tokens
        want = reference.logits(verified, drafts[:-1]).softmax(-1)
        torch.testing.assert_close(q[:, vocab], want, rtol=2e-3, atol=2e-4)
        assert q[:, 200:].sum() == 0  # zero outside the draft vocabulary


def test_greedy_drafts_are_the_argmax_and_carry_no_q_beside_sampled_rows_that_do(
    tiny_model_dir, random_eagle
):
    """In one batch: greedy requests (their drafts the argmax of the draft's reduced
    logits; no q, which coupled verification never reads), a greedy request with a
    repetition penalty and seeded ones at temperature 1 (both with the contract's q)."""
    draft_dir = random_eagle(tiny_model_dir, vocab=200)
    engine, reference, seen = _recording_eagle_engine(tiny_model_dir, draft_dir)
    k4 = dict(max_tokens=20, ignore_eos=True, num_speculative_tokens=4)
    kinds = {
        "greedy": SamplingParams(temperature=0.0, **k4),
        "penalised": SamplingParams(temperature=0.0, repetition_penalty=1.3, **k4),
        "seeded": SamplingParams(temperature=1.0, seed=5, **k4),
    }
    prompts = prompts_of_lengths([6, 19, 30, 11], seed=4)
    work = [(f"{kind}-{i}", p, kinds[kind]) for i, (kind, p) in
            enumerate(zip(["greedy", "seeded", "greedy", "penalised"], prompts))]  # fmt: skip
    run_to_completion(engine, {0: work})
    assert_all_blocks_released(engine)
    by_kind = {kind: [x for x in seen if x[0].startswith(kind)] for kind in kinds}
    assert all(len(rows) >= 4 for rows in by_kind.values()), {k: len(v) for k, v in by_kind.items()}
    for _, verified, drafts, q in by_kind["greedy"]:
        assert q is None and drafts
        assert reference.logits(verified, drafts[:-1]).argmax(-1).tolist() == drafts
    for kind in ("penalised", "seeded"):
        for _, _verified, drafts, q in by_kind[kind]:
            assert q is not None and len(q) == len(drafts)
            assert q[:, 200:].sum() == 0
    for _, verified, drafts, q in by_kind["seeded"]:
        want = reference.logits(verified, drafts[:-1]).softmax(-1)
        torch.testing.assert_close(q[:, :200], want, rtol=2e-3, atol=2e-4)


# ---- the draft cache ------------------------------------------------------------------
def _check_draft_cache(engine) -> None:
    """After every step: the draft KV holds whole verified positions only (no drafted
    slot), never past the last verified token, block table trimmed to its length."""
    proposer = engine.proposer
    bs = engine.config.block_size
    for ereq in proposer._requests.values():
        assert not ereq.fed
        assert ereq.num_computed_tokens < ereq.num_tokens
        held = len(proposer.kv.get_block_ids(ereq.request_id))
        assert held == -(-ereq.num_computed_tokens // bs), ereq.request_id


def _held_out_chat_prompts(model_dir: str, n: int) -> list[list[int]]:
    """Built-in prompts the tiny EAGLE draft was not trained on (it saw the first 48), in
    the chat template: the shape of its training data."""
    from transformers import AutoTokenizer

    from engine.benchmarks.offline import tokenize_prompts
    from engine.train_draft.prompts import builtin_prompts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenize_prompts(tokenizer, builtin_prompts(48 + n, seed=0)[48:], chat=True)


def test_accepted_drafts_are_fed_again_with_the_targets_features(
    tiny_model_dir, tiny_eagle_draft_dir
):
    """With a trained draft some bursts are accepted whole: the cache keeps only the
    catch-up, the next burst feeds the accepted tokens with the target's features, and
    greedy output is the target's."""
    prompts = _held_out_chat_prompts(tiny_model_dir, 4)
    reference = run_to_completion(
        make_engine(tiny_model_dir),
        {0: [(f"r{i}", p, greedy(40)) for i, p in enumerate(prompts)]},
    )
    engine = make_engine(
        tiny_model_dir, speculative_method="eagle", draft_model=tiny_eagle_draft_dir,
        speculative_disable_batch_size=64,
    )  # fmt: skip
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(40, num_speculative_tokens=4))
    tokens: dict[str, list[int]] = {}
    full_accepts = 0
    while engine.has_unfinished_requests():
        before = engine.stats.num_accepted_tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            full_accepts += len(out.token_ids) == 5
        assert engine.stats.num_accepted_tokens >= before
        _check_draft_cache(engine)
    assert_all_blocks_released(engine)
    assert {r: v["token_ids"] for r, v in reference.items()} == tokens
    assert engine.stats.num_accepted_tokens > 0
    assert full_accepts > 0


def test_a_second_request_with_the_same_prompt_hits_the_draft_prefix_cache(
    tiny_model_dir, random_eagle
):
    draft_dir = random_eagle(tiny_model_dir)
    engine = make_engine(tiny_model_dir, speculative_method="eagle", draft_model=draft_dir)
    prompt = prompts_of_lengths([50], seed=9)[0]
    first = run_to_completion(engine, {0: [("a", prompt, greedy(8, num_speculative_tokens=3))]})
    kv = engine.proposer.kv
    hits_before = kv.num_prefix_hit_tokens
    second = run_to_completion(engine, {0: [("b", prompt, greedy(8, num_speculative_tokens=3))]})
    assert kv.num_prefix_hit_tokens - hits_before >= 48  # three full blocks of the prompt
    assert first["a"]["token_ids"] == second["b"]["token_ids"]
    assert_all_blocks_released(engine)


# ---- refusals ------------------------------------------------------------------------
def test_eagle_needs_an_eagle_draft(tiny_model_dir, tiny_draft_model_dir):
    with pytest.raises(ValueError, match="needs an EAGLE draft") as e:
        make_engine(tiny_model_dir, speculative_method="eagle", draft_model=tiny_draft_model_dir)
    assert "\n" not in str(e.value)


def test_an_eagle_draft_for_another_target_is_refused_in_one_line(
    tiny_model_factory, tiny_model_dir, random_eagle
):
    draft_dir = random_eagle(tiny_model_dir)
    other = tiny_model_factory(seed=1)
    with pytest.raises(ModelLoadError, match="was made for") as e:
        load_draft(draft_dir, load_model(other, dtype="float32", device="cpu"))
    assert "\n" not in str(e.value)


def test_aux_layers_outside_the_target_are_refused(tiny_model_dir, random_eagle, tmp_path):
    import shutil

    draft_dir = tmp_path / "bad"
    shutil.copytree(random_eagle(tiny_model_dir), draft_dir)
    meta = json.loads((draft_dir / "draft.json").read_text())
    (draft_dir / "draft.json").write_text(json.dumps({**meta, "aux_layers": [0, 5]}))
    with pytest.raises(ModelLoadError, match=r"aux layers must be .* in \[0, 1\]"):
        load_draft(str(draft_dir), load_model(tiny_model_dir, dtype="float32", device="cpu"))


def test_the_loaded_draft_shares_the_targets_embedding(tiny_model_dir, random_eagle):
    target = load_model(tiny_model_dir, dtype="float32", device="cpu")
    draft = load_draft(random_eagle(tiny_model_dir), target)
    assert isinstance(draft.model, EagleDraftForCausalLM)
    assert draft.model.model.embed_tokens is target.model.model.embed_tokens
    assert len(draft.model.model.layers) == 1


# ---- the default policy ---------------------------------------------------------------
def test_auto_picks_hybrid_with_a_draft_and_ngram_without(monkeypatch, tmp_path):
    from engine import default_model
    from engine.config import EngineConfig

    monkeypatch.setattr(default_model, "default_draft_path", lambda eagle=False: None)
    assert EngineConfig(speculative_method="auto").resolved_speculative_method == "ngram"
    shipped = tmp_path / "eagle"
    monkeypatch.setattr(
        default_model, "default_draft_path", lambda eagle=False: shipped if eagle else None
    )
    config = EngineConfig(speculative_method="auto")
    assert config.resolved_speculative_method == "hybrid"
    assert config.resolved_draft_model == str(shipped)
    # another model: the shipped draft is not for it
    other = EngineConfig(model="some/other", speculative_method="auto")
    assert other.resolved_speculative_method == "ngram"
    mine = EngineConfig(model="some/other", speculative_method="auto", draft_model="d")
    assert (mine.resolved_speculative_method, mine.resolved_draft_model) == ("hybrid", "d")


def test_the_draft_cost_adaptive_k_uses_is_measured(tiny_model_dir, random_eagle):
    engine = make_engine(tiny_model_dir, speculative_method="eagle",
                         draft_model=random_eagle(tiny_model_dir))  # fmt: skip
    prior = engine.proposer.draft_cost
    assert engine.scheduler.draft_cost == prior
    prompts = prompts_of_lengths([12, 30], seed=4)
    run_to_completion(engine, {0: [(f"r{i}", p, greedy(40, num_speculative_tokens=4))
                                   for i, p in enumerate(prompts)]})  # fmt: skip
    assert engine.proposer.cost_meter.burst._steps >= 8
    assert engine.scheduler.draft_cost != prior
    assert engine.scheduler.draft_cost == engine.proposer.draft_cost > 0


def test_features_gathered_while_not_speculating_are_read_back_and_cut_at_the_limit(
    tiny_model_dir, random_eagle, monkeypatch
):
    """Each target forward appends its rows as one chunk (no copy of the ones before);
    a rewrite from a rejected position replaces the rest; reads see position by
    position what was written, zeros where nothing was; past the limit the oldest go."""
    from engine.spec_decode import eagle_proposer

    monkeypatch.setattr(eagle_proposer, "MAX_PENDING_FEATURES", 40)
    engine = make_engine(
        tiny_model_dir, speculative_method="eagle", draft_model=random_eagle(tiny_model_dir)
    )
    proposer = engine.proposer
    hidden = proposer.hidden_size
    ereq = eagle_proposer._EagleRequest("x", [])
    expected = torch.zeros(400, hidden)

    def write(start, n, value):
        rows = torch.full((n, hidden), float(value)).to(proposer.model.dtype)
        proposer._append_features("x", start, rows)
        expected[start : start + n] = float(value)

    write(10, 7, 1)
    for step in range(20):  # one position a step
        write(17 + step, 1, 2 + step)
    assert len(proposer._features["x"].chunks) == 21  # appended, not joined
    write(30, 3, 50)  # rejected drafts from 30 on: rewritten, the rest dropped
    expected[33:37] = 0
    got = proposer._hidden_for(ereq, 0, 40).float()
    assert torch.equal(got, expected[:40])
    for step in range(300):  # far past the limit of 40 (+256 slack before a cut)
        write(33 + step, 1, 100 + step % 7)
    feats = proposer._features["x"]
    assert feats.end == 333 and 40 <= feats.end - feats.start <= 40 + 256
    got = proposer._hidden_for(ereq, feats.start - 5, 10).float()
    assert torch.equal(got[:5], torch.zeros(5, hidden))  # cut: read as zeros
    assert torch.equal(got[5:], expected[feats.start : feats.start + 5])


def _kept_and_pinned_bytes(proposer) -> tuple[int, int]:
    """(bytes of the feature rows the proposer keeps, bytes of the distinct storages
    holding them)."""
    chunks = [chunk for feats in proposer._features.values() for chunk in feats.chunks]
    kept = sum(chunk.nelement() * chunk.element_size() for chunk in chunks)
    storages = {c.untyped_storage().data_ptr(): c.untyped_storage().nbytes() for c in chunks}
    return kept, sum(storages.values())


def test_kept_features_pin_no_more_than_their_own_rows(tiny_model_dir, random_eagle):
    """A long run of mixed prompt lengths, some requests speculating and some not (those
    gather a row a step): the storages under the kept features stay within twice the
    bytes of the rows, at every step, and a finished request keeps none. (Each kept row
    used to be a view into its step's whole feature tensor, prefills of finished
    requests included: 425 rows pinned 106x their bytes at step 420.)"""
    engine = make_engine(
        tiny_model_dir, speculative_method="eagle", draft_model=random_eagle(tiny_model_dir),
        num_kv_blocks=256, speculative_disable_batch_size=64,
    )  # fmt: skip
    proposer = engine.proposer
    lengths = [5, 300, 40, 170, 12, 250, 90, 3, 200, 60] * 4
    arrivals = {
        4 * i: [(f"r{i}", prompt, greedy(30 + i % 3 * 25, num_speculative_tokens=i % 2 * 4))]
        for i, prompt in enumerate(prompts_of_lengths(lengths, seed=5))
    }
    finished: set[str] = set()
    for step in range(2000):
        for request_id, prompt, params in arrivals.pop(step, []):
            engine.add_request(request_id, prompt, params)
        if not engine.has_unfinished_requests() and not arrivals:
            break
        finished |= {out.request_id for out in engine.step() if out.finished}
        kept, pinned = _kept_and_pinned_bytes(proposer)
        assert pinned <= 2 * kept, f"step {step}: {kept} bytes of rows pin {pinned}"
        assert not finished & set(proposer._features)
    assert len(finished) == len(lengths)
    assert not proposer._features and _kept_and_pinned_bytes(proposer) == (0, 0)
    assert_all_blocks_released(engine)
