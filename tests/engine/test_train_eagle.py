"""`specserve train-draft --method eagle`: the exported draft, the training-time-test
mask, training, resume, the features cache and the flags (engine/train_draft/eagle.py).
The draft as served against the contract is tested in test_eagle.py."""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.entrypoints.cli import main
from engine.loader import load_model
from engine.models.layers import apply_rope, rope_inv_freq
from engine.spec_decode.eagle import EagleDraftForCausalLM
from engine.spec_decode.trained_draft import load_draft
from engine.train_draft import eagle as eagle_training
from engine.train_draft.data import MANIFEST_FLAGS, _write_shard, load_sequences
from engine.train_draft.eagle import (
    EagleSettings,
    EagleTrainModel,
    ensure_features,
    evaluate_eagle,
    teacher_forced_logits,
    train_eagle,
    ttt_mask,
    unrolled_logits,
)
from engine.train_draft.model import DraftLM, choose_vocab
from engine.train_draft.train import TrainSettings, split_heldout, train

_FAST = ["--max-tokens", "24", "--epochs", "1", "--tokens-per-batch", "512"]
_FAST += ["--train-dtype", "float32"]


def _eagle(model_dir, out, *extra) -> int:
    argv = ["train-draft", "--method", "eagle", "--model", model_dir, "--out", str(out)]
    return main([*argv, *_FAST, *extra])


def _rerun_argv(draft_dir: Path, out: Path) -> list[str]:
    """The command that made ``draft_dir`` (its draft.json says), into ``out``."""
    argv = shlex.split(json.loads((draft_dir / "draft.json").read_text())["command"])[1:]
    argv[argv.index("--out") + 1] = str(out)
    return argv


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("specserve train-draft: error:")
    return err[0]


@pytest.fixture(scope="module")
def eagle_run(tiny_eagle_draft_dir, tmp_path_factory):
    """A copy of the tiny EAGLE run (data, features, checkpoint, draft): its sequences,
    features and data manifest by flag, for training it again here."""
    out = tmp_path_factory.mktemp("eagle-run") / "run"
    shutil.copytree(tiny_eagle_draft_dir, out)
    sequences = load_sequences(out / "data")
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    made_with = {MANIFEST_FLAGS.get(k, k): v for k, v in manifest.items()}
    return out, sequences, made_with


def _features(run, target_dir):
    out, _, made_with = run
    return ensure_features(Path(target_dir), out / "data", out, [0, 1], 512, made_with)


# ---- the exported draft -----------------------------------------------------------------
def test_the_draft_is_exported_as_the_contract_says_and_loads_for_its_target(
    tiny_model_dir, tiny_eagle_draft_dir
):
    out = Path(tiny_eagle_draft_dir)
    meta = json.loads((out / "draft.json").read_text())
    assert (meta["format"], meta["method"], meta["aux_layers"]) == (
        "specserve-draft",
        "eagle",
        [0, 1],
    )
    assert meta["draft_vocab_size"] == 200 and meta["settings"]["ttt_steps"] == 3
    assert " --method eagle " in meta["command"]
    by_epoch = meta["training"]["heldout_tokens_per_verification_by_epoch"]
    assert len(by_epoch) == 3 and all(1.0 <= x <= 5.0 for x in by_epoch)
    assert by_epoch[-1] > 1.0  # some drafts would be accepted
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    weights = load_file(str(out / "model.safetensors"))
    layer = "model.layers.0."
    assert set(weights) == {
        "eagle.fc.weight", "eagle.embed_norm.weight", "eagle.hidden_norm.weight",
        "eagle.in_proj.weight", "model.norm.weight", "specserve.draft_vocab",
        "specserve.embed_probe", f"{layer}input_layernorm.weight",
        f"{layer}post_attention_layernorm.weight",
        *(f"{layer}self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"{layer}mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    }  # fmt: skip
    assert weights["eagle.fc.weight"].shape == (64, 2 * 64)
    assert weights["eagle.in_proj.weight"].shape == (64, 2 * 64)
    assert all(t.dtype == torch.bfloat16 for n, t in weights.items() if not n.startswith("spec"))
    assert weights["specserve.draft_vocab"].dtype == torch.int64
    assert (out / "model.safetensors").stat().st_mode & 0o044 == 0o044

    target = load_model(tiny_model_dir, dtype="float32")
    served = load_draft(str(out), target)
    assert isinstance(served.model, EagleDraftForCausalLM)
    assert served.model.aux_layers == [0, 1]
    g = torch.randn(3, 128)
    torch.testing.assert_close(served.model.fuse(g), g @ weights["eagle.fc.weight"].float().t())


# ---- training-time test -----------------------------------------------------------------
def test_the_ttt_mask_is_the_serving_cache():
    mask = ttt_mask(6, 2)
    assert mask.shape == (6, 18)
    # depth 2 at position 4 (root 2): depth-0 keys 0..2, the depth-1 key at 3, depth-2 at 4
    assert mask[4].nonzero().flatten().tolist() == [0, 1, 2, 6 + 3, 12 + 4]
    # position 1 has no root in the sequence: its own depth-1 and depth-2 keys only
    assert mask[1].nonzero().flatten().tolist() == [6 + 0, 12 + 1]
    assert ttt_mask(5, 0).equal(torch.ones(5, 5).tril().bool())  # depth 0: causal


def _untrained(target_dir) -> EagleTrainModel:
    torch.manual_seed(0)
    model = EagleTrainModel(Path(target_dir), np.arange(259), [0, 1])
    with torch.no_grad():  # away from the init's structure (identity in_proj half)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def test_a_depth_s_draft_reads_only_what_the_serving_cache_holds(tiny_model_dir):
    """Depth s at position j drafts from the root r = j - s: it must not read the
    target's features of positions >= r (not computed when serving) nor tokens after
    j, and must read those before."""
    model = _untrained(tiny_model_dir)
    gen = torch.Generator().manual_seed(1)
    length, j = 14, 10
    tokens = torch.randint(3, 259, (length,), generator=gen)
    g = torch.randn(length, 128, generator=gen)
    for s in range(4):
        base = unrolled_logits(model, tokens, g, s)[j]

        def row(tokens_, g_, s=s):
            return unrolled_logits(model, tokens_, g_, s)[j]

        later = g.clone()
        later[j - s :] += 3 * torch.randn(length - j + s, 128, generator=gen)
        torch.testing.assert_close(row(tokens, later), base, rtol=0, atol=1e-5)
        after = tokens.clone()
        after[j + 1 :] = (after[j + 1 :] + 7) % 256 + 3
        torch.testing.assert_close(row(after, g), base, rtol=0, atol=1e-5)
        before_root = g.clone()
        before_root[j - s - 1] += 3 * torch.randn(128, generator=gen)
        assert (row(tokens, before_root) - base).abs().max() > 1e-3, s
        first = tokens.clone()
        first[0] = (first[0] + 1) % 256 + 3
        assert (row(first, g) - base).abs().max() > 1e-3, s
        if s:
            step_token = tokens.clone()
            step_token[j - s + 1] = (step_token[j - s + 1] + 1) % 256 + 3
            assert (row(step_token, g) - base).abs().max() > 1e-3, s
    torch.testing.assert_close(
        teacher_forced_logits(model, tokens, g), unrolled_logits(model, tokens, g, 0)
    )


def _drafted_one_at_a_time(model: EagleTrainModel, tokens, g, root: int, steps: int):
    """The draft as served, one position at a time over a growing cache: positions
    0..root read the target's features of the position before (zeros before 0), then
    each step feeds the next token with the draft's own output before it. Logits at
    positions root .. root + steps - 1."""
    arch = model.arch
    layer = model.model.layers[0]
    attn = layer.self_attn
    inv_freq = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
    f = model.eagle.fc(g)
    keys, values, logits = [], [], []
    previous = torch.zeros(arch.hidden_size)
    for j in range(root + steps):
        h = previous if j > root else (f[j - 1] if j else torch.zeros(arch.hidden_size))
        e = model.embed[tokens[j]]
        u = model.eagle.in_proj(torch.cat([model.eagle.embed_norm(e), model.eagle.hidden_norm(h)]))
        x = layer.input_layernorm(u)
        angle = j * inv_freq
        cos, sin = angle.cos().view(1, 1, -1), angle.sin().view(1, 1, -1)
        q = apply_rope(attn.q_proj(x).view(1, arch.num_heads, arch.head_dim), cos, sin)[0]
        keys.append(apply_rope(attn.k_proj(x).view(1, arch.num_kv_heads, -1), cos, sin)[0])
        values.append(attn.v_proj(x).view(arch.num_kv_heads, -1))
        group = arch.num_heads // arch.num_kv_heads
        k_all = torch.stack(keys).repeat_interleave(group, dim=1)
        v_all = torch.stack(values).repeat_interleave(group, dim=1)
        weights = (torch.einsum("hd,thd->ht", q, k_all) / math.sqrt(arch.head_dim)).softmax(-1)
        r = u + attn.o_proj(torch.einsum("ht,thd->hd", weights, v_all).reshape(-1))
        previous = r + layer.mlp(layer.post_attention_layernorm(r))
        if j >= root:
            logits.append(model.logits(previous))
    return torch.stack(logits)


@torch.no_grad()
def test_unrolled_depths_are_the_drafts_made_one_position_at_a_time(tiny_model_dir):
    model = _untrained(tiny_model_dir)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(3, 259, (16,), generator=gen)
    g = torch.randn(16, 128, generator=gen)
    unrolled = [unrolled_logits(model, tokens, g, s) for s in range(4)]
    for root in (0, 5, 12):
        reference = _drafted_one_at_a_time(model, tokens, g, root, 4)
        for s in range(4):
            torch.testing.assert_close(
                unrolled[s][root + s], reference[s], rtol=1e-4, atol=1e-4, msg=f"{root} {s}"
            )


# ---- training ---------------------------------------------------------------------------
def test_training_lowers_the_loss_and_reports_tokens_per_verification(eagle_run, tiny_model_dir):
    out, sequences, made_with = eagle_run
    features = _features(eagle_run, tiny_model_dir)
    vocab = choose_vocab(sequences, 259, 200, {2})
    torch.manual_seed(0)
    model = EagleTrainModel(Path(tiny_model_dir), vocab, [0, 1])
    settings = EagleSettings(epochs=4, tokens_per_batch=1024, warmup_steps=5, aux_layers=[0, 1])
    _, heldout = split_heldout(list(range(len(sequences))), settings.seed)
    index_of = np.full(259, -100)
    index_of[vocab] = np.arange(len(vocab))
    before = evaluate_eagle(model, sequences, features, heldout, index_of, settings)
    losses, epochs = [], []
    result = train_eagle(
        model, sequences, features, out / "fresh", settings,
        lambda step, total, loss: losses.append(loss), made_with,
        on_epoch=lambda epoch, e: epochs.append(e),
    )  # fmt: skip
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.5
    assert len(epochs) == len(result.by_epoch) == 4
    assert all(1.0 <= e.tokens_per_verification <= 5.0 for e in epochs)
    assert all(0.0 <= e.top1 <= 1.0 and len(e.accept_by_depth) == 4 for e in epochs)
    # each depth is accepted only after the ones before it
    assert all(a >= b for e in epochs for a, b in zip(e.accept_by_depth, e.accept_by_depth[1:]))
    assert result.final.tokens_per_verification > before.tokens_per_verification
    assert result.final.top1 > before.top1


def test_interrupted_training_resumes_to_the_same_weights(eagle_run, tiny_model_dir, tmp_path):
    _, sequences, made_with = eagle_run
    features = _features(eagle_run, tiny_model_dir)
    vocab = choose_vocab(sequences, 259, 150, {2})
    settings = EagleSettings(
        epochs=2, tokens_per_batch=512, checkpoint_every=3, warmup_steps=2, aux_layers=[0, 1]
    )

    def fresh() -> EagleTrainModel:
        torch.manual_seed(0)
        return EagleTrainModel(Path(tiny_model_dir), vocab, [0, 1])

    whole = fresh()
    train_eagle(whole, sequences, features, tmp_path / "whole", settings, made_with=made_with)

    class Interrupt(Exception):
        pass

    def stop_at_7(step, total, loss):
        if step == 7:
            raise Interrupt

    (tmp_path / "cut").mkdir()
    with pytest.raises(Interrupt):
        train_eagle(fresh(), sequences, features, tmp_path / "cut", settings, stop_at_7, made_with)
    steps = []
    resumed = fresh()
    result = train_eagle(
        resumed, sequences, features, tmp_path / "cut", settings,
        lambda s, t, loss: steps.append(s), made_with,
    )  # fmt: skip
    assert steps[0] == 7  # after the checkpoint at step 6
    assert result.steps == steps[-1] == result.total_steps
    for name, tensor in whole.trained_state().items():
        assert torch.equal(tensor, resumed.trained_state()[name]), name
    # another --ttt-steps: the checkpoint is refused, naming the flag
    other = EagleSettings(**{**settings.__dict__, "ttt_steps": 2})
    with pytest.raises(ValueError, match=r"other settings \(--ttt-steps 3, now 2\)"):
        train_eagle(fresh(), sequences, features, tmp_path / "cut", other, made_with=made_with)


def test_a_time_budget_stops_after_the_step_checkpointed_and_a_rerun_resumes(
    eagle_run, tiny_model_dir, tmp_path
):
    _, sequences, made_with = eagle_run
    features = _features(eagle_run, tiny_model_dir)
    vocab = choose_vocab(sequences, 259, 150, {2})
    settings = EagleSettings(epochs=2, tokens_per_batch=512, aux_layers=[0, 1])
    passed = time.perf_counter()
    stopped = train_eagle(
        EagleTrainModel(Path(tiny_model_dir), vocab, [0, 1]), sequences, features, tmp_path,
        settings, made_with=made_with, deadline=passed,
    )  # fmt: skip
    assert stopped.stopped_by_time_budget and stopped.steps == 1 < stopped.total_steps
    assert stopped.by_epoch == [] and 1.0 <= stopped.final.tokens_per_verification <= 5.0
    steps = []
    rest = train_eagle(
        EagleTrainModel(Path(tiny_model_dir), vocab, [0, 1]), sequences, features, tmp_path,
        settings, lambda s, t, loss: steps.append(s), made_with,
    )  # fmt: skip
    assert steps[0] == 2 and not rest.stopped_by_time_budget and len(rest.by_epoch) == 2
    # the layers method stops the same way
    (tmp_path / "layers").mkdir()
    layers = train(
        DraftLM(Path(tiny_model_dir), 1, vocab), sequences, tmp_path / "layers",
        TrainSettings(num_layers=1, epochs=2, tokens_per_batch=512), deadline=passed,
    )  # fmt: skip
    assert layers.stopped_by_time_budget and layers.steps == 1 < layers.total_steps


# ---- the features cache -----------------------------------------------------------------
def test_features_are_the_targets_hidden_states_and_are_computed_once(
    tiny_model_factory, tmp_path, monkeypatch
):
    from transformers import AutoModelForCausalLM

    target = tiny_model_factory(num_hidden_layers=4)
    gen = np.random.default_rng(0)
    data = tmp_path / "data"
    data.mkdir()
    shards = []
    for shard in range(2):
        seqs = [gen.integers(3, 259, int(gen.integers(4, 40))).tolist() for _ in range(5)]
        _write_shard(data / f"shard-{shard:05d}.npz", seqs, [3] * 5)
        shards.append(seqs)
    calls = []
    real = eagle_training.feature_model
    monkeypatch.setattr(eagle_training, "feature_model", lambda *a: calls.append(a) or real(*a))

    def features(aux):
        return ensure_features(Path(target), data, tmp_path, aux, 32, {"--model": "t"},
                               tokens_per_batch=64)  # fmt: skip

    store = features([0, 2])
    assert len(calls) == 1 and len(store) == 10
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for i, seq in enumerate(s for seqs in shards for s in seqs):
        with torch.no_grad():
            states = hf(torch.tensor([seq[:32]]), output_hidden_states=True).hidden_states
        want = torch.cat([states[0][0], states[2][0]], dim=-1).to(torch.bfloat16)
        got = store.get(i)
        assert got.dtype == torch.bfloat16 and got.shape == (min(len(seq), 32), 128)
        torch.testing.assert_close(got, want)
    files = sorted((tmp_path / "eagle-features").glob("shard-*.npy"))
    stamps = [f.stat().st_mtime_ns for f in files]
    # a rerun computes nothing
    again = features([0, 2])
    assert len(calls) == 1 and [f.stat().st_mtime_ns for f in files] == stamps
    assert torch.equal(again.get(7), store.get(7))
    # a changed shard is computed again, alone
    changed = [[5, 6, 7, 8, 9]] + shards[1][1:]
    _write_shard(data / "shard-00001.npz", changed, [3] * 5)
    features([0, 2])
    assert len(calls) == 2
    assert files[0].stat().st_mtime_ns == stamps[0] and files[1].stat().st_mtime_ns != stamps[1]
    # other aux layers: every shard again
    other = features([1, 3])
    assert len(calls) == 3 and other.get(0).shape == (min(len(shards[0][0]), 32), 128)
    manifest = json.loads((tmp_path / "eagle-features" / "manifest.json").read_text())
    assert manifest["--aux-layers"] == "1,3"


# ---- the command ------------------------------------------------------------------------
def test_a_rerun_resumes_without_recomputing_features_and_refuses_other_settings(
    tiny_model_dir, tiny_eagle_draft_dir, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    shutil.copytree(tiny_eagle_draft_dir, out)
    argv = _rerun_argv(Path(tiny_eagle_draft_dir), out)
    features = out / "eagle-features"
    stamps = {f.name: f.stat().st_mtime_ns for f in features.iterdir()}
    weights = load_file(str(out / "model.safetensors"))
    monkeypatch.setattr(eagle_training, "feature_model", lambda *a: pytest.fail("recomputed"))
    assert main(argv) == 0  # the finished run, exported again as it is
    assert {f.name: f.stat().st_mtime_ns for f in features.iterdir()} == stamps
    again = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(weights[n], again[n]) for n in weights)
    for flags, differs in (
        (["--ttt-steps", "2"], "--ttt-steps 3, now 2"),
        (["--aux-layers", "1"], "--aux-layers 0,1, now 1"),
        (["--draft-vocab", "100"], "--draft-vocab 200, now 100"),
    ):
        capsys.readouterr()
        assert main([*argv, *flags]) == 2
        line = _one_line_error(capsys)
        assert f"checkpoint.pt was made with other settings ({differs}); " in line, line
    # the layers method does not take an eagle checkpoint
    layers = [a for a in argv if a not in ("--method", "eagle")]
    capsys.readouterr()
    assert main(layers) == 2
    assert "was made with other settings (--method eagle, now layers" in _one_line_error(capsys)
    assert {f.name: f.stat().st_mtime_ns for f in features.iterdir()} == stamps


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-layers", "2"], "--num-layers does not apply to --method eagle"),
        (["--ttt-steps", "0"], r"--ttt-steps must be \[1, 16\], got 0"),
        (["--aux-layers", "1,0"], "--aux-layers must be distinct ascending layer indices"),
        (["--aux-layers", "x"], "--aux-layers must be comma-separated layer indices"),
        (["--aux-layers", "0,5"], "--aux-layers must name layers of the target's 2"),
        (["--time-budget", "0"], "--time-budget must be > 0 minutes"),
    ],
)
def test_bad_eagle_flags_are_one_line(tiny_model_dir, tmp_path, capsys, flags, message):
    assert _eagle(tiny_model_dir, tmp_path / "d", "--num-prompts", "4", *flags) == 2
    assert re.search(message, _one_line_error(capsys))
    assert not (tmp_path / "d" / "data").exists()  # refused before any answer


def test_eagle_flags_are_refused_for_the_layers_method(tiny_model_dir, tmp_path, capsys):
    argv = ["train-draft", "--model", tiny_model_dir, "--out", str(tmp_path / "d")]
    assert main([*argv, "--ttt-steps", "2"]) == 2
    assert "--ttt-steps applies to --method eagle only" in _one_line_error(capsys)


def test_eagle_trains_for_qwen2_and_tied_targets_and_within_a_time_budget(
    tiny_model_factory, tmp_path, capsys
):
    target = tiny_model_factory(arch="qwen2", tie_word_embeddings=True)
    out = tmp_path / "qwen2"
    capsys.readouterr()
    assert _eagle(target, out, "--num-prompts", "8", "--epochs", "3", "--time-budget", "1e-4") == 0
    assert re.search(r"--time-budget: stopped after step 1 of \d+", capsys.readouterr().err)
    meta = json.loads((out / "draft.json").read_text())
    assert meta["training"]["steps"] == 1 and meta["training"]["stopped_by_time_budget"]
    weights = load_file(str(out / "model.safetensors"))
    assert {f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"} <= set(weights)
    served = load_draft(str(out), load_model(target, dtype="float32"))
    assert isinstance(served.model, EagleDraftForCausalLM)
    # tied: the head is the embedding's rows
    vocab = weights["specserve.draft_vocab"].numpy()
    model = EagleTrainModel(Path(target), vocab, meta["aux_layers"])
    assert torch.equal(model.head, model.embed[torch.as_tensor(vocab)])
