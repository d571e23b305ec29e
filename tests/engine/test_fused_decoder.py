"""The one-call bf16 decoder (engine/kernels/decoder.py) against the layer-by-layer
forward: the same logits bit for bit, step after step, with prefill chunks, decode and
verification-sized queries mixed in one batch; used only where every piece runs on the
kernels; a bad slot or position is one clear error."""

from __future__ import annotations

import random

import pytest
import torch

from engine.loader import load_model
from engine.models.llama import LlamaDecoderLayer
from engine.models.weights import linear_kernels
from tests.engine.simple_runner import SimplePagedRunner

pytestmark = pytest.mark.skipif(
    linear_kernels(torch.zeros(1, 1, dtype=torch.bfloat16)) is None,
    reason="no bf16 Linear kernel here (no FMA): bf16 runs layer by layer on oneDNN",
)


@pytest.fixture(params=["vdpbf16ps", "fma", "amx"])
def bf16_linear(request):
    """Each bf16 Linear kernel this build has, in turn (the process-wide kernels; AMX's
    on this CPU's tiles, else emulated: ``on_amx_tiles``)."""
    from engine.kernels.cpu import cpu_kernels

    kernels = cpu_kernels()
    if request.param == "amx" and "amx" not in kernels.bf16_linear_modes:
        kernels = request.getfixturevalue("on_amx_tiles")
    if request.param not in kernels.bf16_linear_modes:
        pytest.skip(f"no {request.param} bf16 Linear kernel here")
    before = kernels.set_bf16_linear(request.param)
    yield request.param
    kernels.set_bf16_linear(before)


def _runners(model_dir: str) -> tuple[SimplePagedRunner, SimplePagedRunner]:
    """Two runners over two loads of one checkpoint, the same shuffled block lists: the
    first fused, the second layer by layer."""
    fused = SimplePagedRunner(load_model(model_dir, dtype="bfloat16").model, num_blocks=64)
    plain = SimplePagedRunner(load_model(model_dir, dtype="bfloat16").model, num_blocks=64)
    assert fused.model.model.fused is not None
    plain.model.model.fused = None
    return fused, plain


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_fused_decoder_is_the_layer_by_layer_forward_bit_for_bit(
    tiny_model_factory, arch, bf16_linear, monkeypatch
):
    fused, plain = _runners(tiny_model_factory(arch))
    check_one_call_matches_layers(fused, plain, monkeypatch)


def check_one_call_matches_layers(fused, plain, monkeypatch) -> None:
    """Mixed steps (prompts, decodes beside prefill chunks, a verification-sized query,
    a chunk after a cached prefix) through ``fused`` (one call, no Python layer runs,
    nor the final norm and LM head where the call holds them) and ``plain`` (layer by
    layer, the head in Python): the same logits bit for bit, of every row and of each
    chunk's last."""
    rng = random.Random(0)
    vocab = fused.model.config.vocab_size
    for runner in (fused, plain):
        for seq in range(5):
            runner.add_sequence(seq)
    steps = [
        [(0, 37), (1, 1), (2, 20)],  # prompts, one of a single token
        [(0, 1), (1, 30), (3, 5), (4, 16)],  # decode beside prefill chunks
        [(0, 5), (1, 1), (2, 1), (3, 1), (4, 1)],  # a 1 + k verification beside decodes
        [(2, 40), (0, 1)],  # a long chunk after a cached prefix
    ]
    calls = {"n": 0}
    real = LlamaDecoderLayer.forward

    def counted(self, *args, **kwargs):
        calls["n"] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LlamaDecoderLayer, "forward", counted)
    # the head: quantized, or packed for the Linear kernel, in the call
    assert fused.model.model.fused.has_head
    head_calls = {"n": 0}
    head_type = type(fused.model.lm_head)
    real_head = head_type.forward

    def counted_head(self, *args, **kwargs):  # the Linear layers share the head's class
        head_calls["n"] += self is fused.model.lm_head or self is plain.model.lm_head
        return real_head(self, *args, **kwargs)

    monkeypatch.setattr(head_type, "forward", counted_head)
    for i, chunks in enumerate(steps):
        chunks = [(seq, [rng.randrange(vocab) for _ in range(n)]) for seq, n in chunks]
        every_row = i % 2 == 0  # else the last row of each chunk: rows picked in the call
        before = calls["n"], head_calls["n"]
        ours = fused.step(chunks, all_logits=every_row)
        assert (calls["n"], head_calls["n"]) == before  # the fused call did it all
        theirs = plain.step(chunks, all_logits=every_row)
        assert calls["n"] > before[0] and head_calls["n"] == before[1] + 1
        assert ours.shape[0] == (sum(len(c) for _, c in chunks) if every_row else len(chunks))
        assert ours.dtype is torch.float32
        assert torch.equal(ours, theirs)


def test_greedy_output_is_the_same_fused_or_not(tiny_model_dir, bf16_linear):
    fused, plain = _runners(tiny_model_dir)
    prompts = [[5, 6, 7, 8, 9], [100, 3], list(range(20, 60))]
    assert fused.generate_greedy(prompts, 24) == plain.generate_greedy(prompts, 24)


def test_used_only_where_every_piece_runs_on_the_kernels(tiny_model_dir, monkeypatch):
    def fused_after_bind(**kwargs):
        loaded = load_model(tiny_model_dir, **kwargs)
        SimplePagedRunner(loaded.model, num_blocks=8)
        return loaded.model.model.fused

    assert fused_after_bind(dtype="bfloat16") is not None
    assert fused_after_bind(dtype="float32", quantization="none", attn_backend="torch") is None
    assert fused_after_bind(dtype="bfloat16", attn_backend="torch") is None
    monkeypatch.setenv("SPECSERVE_FUSED_DECODER", "0")
    assert fused_after_bind(dtype="bfloat16") is None


def test_a_slot_past_the_cache_is_one_clear_error(tiny_model_dir):
    from engine.attention import build_attention_metadata

    runner = SimplePagedRunner(load_model(tiny_model_dir, dtype="bfloat16").model, num_blocks=8)
    model = runner.model.model
    metadata = build_attention_metadata([2], [2], [[1]], runner.block_size)
    metadata.slot_mapping[1] = 8 * runner.block_size  # one past the last slot
    hidden = model.embed_tokens(torch.tensor([3, 4]))
    rope = model.rotary.for_positions(torch.tensor([0, 1]), torch.bfloat16)
    with pytest.raises(ValueError, match=r"a slot in slot_mapping is past the cache's 128 slots"):
        model.fused(
            hidden, rope.positions, rope.table, metadata, torch.tensor([0], dtype=torch.int32), 2
        )
    with pytest.raises(ValueError, match="positions"):
        model.fused(
            hidden,
            rope.positions[:1],
            rope.table,
            metadata,
            torch.tensor([0], dtype=torch.int32),
            2,
        )


def test_the_head_in_the_call_takes_only_increasing_rows_of_the_step(tiny_model_dir):
    """``FusedDecoderLayers.logits``: the rows whose logits the call computes must be
    increasing rows of the step, each once (the final norm updates a row's residual in
    place): anything else is one clear error before any layer runs, and the rows it
    takes give compute_logits' bits on the forward's output."""
    from engine.attention import build_attention_metadata

    runner = SimplePagedRunner(load_model(tiny_model_dir, dtype="bfloat16").model, num_blocks=8)
    model = runner.model
    metadata = build_attention_metadata([3], [3], [[1]], runner.block_size)
    hidden = model.model.embed_tokens(torch.tensor([3, 4, 5]))
    rope = model.model.rotary.for_positions(torch.tensor([0, 1, 2]), torch.bfloat16)
    seq_ids = torch.tensor([0], dtype=torch.int32)

    def logits(rows):
        return model.model.fused.logits(
            hidden.clone(), rope.positions, rope.table, metadata, seq_ids, 3, rows
        )

    for rows in ([1, 1], [2, 0], [0, 3], [-1]):
        with pytest.raises(ValueError, match="logit_rows must be increasing rows of the step"):
            logits(torch.tensor(rows))
    with pytest.raises(ValueError, match="logit_rows"):
        logits(torch.tensor([0, 1], dtype=torch.int32))
    out, residual = model.model.fused(hidden.clone(), rope.positions, rope.table, metadata,
                                      seq_ids, 3)  # fmt: skip
    normed = model.model.norm(out, residual)[0]
    for rows in ([0, 2], [1], []):
        expected = model.lm_head(normed[torch.tensor(rows, dtype=torch.long)]).float()
        got = logits(torch.tensor(rows, dtype=torch.long))
        assert got.dtype is torch.float32 and torch.equal(got, expected)
    # widened in the call: the bf16 head's bits as float32
    assert torch.equal(logits(None), model.lm_head(normed).float())
