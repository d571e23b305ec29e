"""Quantized weights in the model: a .gguf's Q4_0 / Q4_1 / Q8_0 tensors served as stored,
``--quantization int8`` for any model, and ``--quantization none`` unchanged.

The reference for a quantized model is the same model dequantized, run in float with
each Linear's input quantized as the kernel quantizes it (int8 per row and 32-block):
everything else (Q/K row order, fusing q/k/v and gate/up, the embedding and head, the
one-call decoder) must then agree up to fp32 summation order.
"""

from __future__ import annotations

import logging

import pytest
import torch

from engine.loader import load_model
from engine.models.quant import QuantizedEmbedding, QuantizedLinear, quantize_int8
from engine.models.weights import PackedLinear
from tests.engine.engine_helpers import assert_all_blocks_released, make_engine, run_to_completion
from tests.engine.simple_runner import SimplePagedRunner
from tests.engine.test_quant_kernels import quantized_activations

PROMPTS = [[5, 6, 7, 8, 9], [100, 3], list(range(20, 60)), [1, 200, 17, 17, 17]]


def _logits(model, prompts=PROMPTS, layer_by_layer: bool = False) -> torch.Tensor:
    """Every position's logits [sum(len), vocab] of one prefill of ``prompts``;
    ``layer_by_layer``: through the Python modules (a patched Linear's forward runs)
    even where the one-call decoder would."""
    runner = SimplePagedRunner(model, num_blocks=64)
    if layer_by_layer:
        model.model.fused = None
    for seq in range(len(prompts)):
        runner.add_sequence(seq)
    return runner.step(list(enumerate(prompts)), all_logits=True).float()


def _fake_quantized(model) -> None:
    """Quantize each float Linear's input as the kernel does (the reference)."""
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, PackedLinear)):
            forward = module.forward
            module.forward = lambda x, f=forward: f(quantized_activations(x).to(x.dtype))


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits, -1)
    return float((p.exp() * (p - torch.log_softmax(q_logits, -1))).sum(-1).mean())


@pytest.mark.parametrize(
    ("linear", "embedding", "tied"),
    [("Q4_1", "Q8_0", False), ("Q4_0", "Q4_0", True), ("Q8_0", "Q8_0", True)],
)
def test_a_gguf_is_served_as_stored_and_matches_its_reference(
    tiny_gguf_factory, linear, embedding, tied
):
    path = tiny_gguf_factory(linear, embedding, tie_word_embeddings=tied)
    served = load_model(path, device="cpu", dtype="float32")
    model = served.model
    assert served.quantization == "gguf"
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and qkv.weight_q.format == linear
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert isinstance(model.lm_head, QuantizedLinear)
    if tied:  # one packed weight serves the lookup and the head
        assert model.lm_head.weight_q is model.model.embed_tokens.weight_q
    reference = load_model(path, device="cpu", dtype="float32", quantization="none").model
    assert isinstance(reference.model.layers[0].self_attn.qkv_proj, PackedLinear)
    plain = _logits(reference)
    _fake_quantized(reference)
    ours, theirs = _logits(model), _logits(reference, layer_by_layer=True)
    # fp32 summation order differs, and now and then moves an activation onto the other
    # side of a rounding boundary (one quantization step): rare and small next to what
    # quantizing costs at all, which a wrong row order or scale would dwarf.
    diff, cost = (ours - theirs).abs(), (ours - plain).abs()
    assert diff.mean() < 0.01 * cost.mean() and (diff > 1e-4).float().mean() < 0.05
    assert _kl(plain, ours) < 0.01


def test_the_served_gguf_agrees_with_transformers_reading_it_dequantized(tiny_gguf_path):
    """--quantization none: the very tensors transformers dequantizes from the file."""
    from transformers import AutoModelForCausalLM

    ours = load_model(tiny_gguf_path, device="cpu", dtype="float32", quantization="none")
    hf = AutoModelForCausalLM.from_pretrained(
        str(ours.gguf_path.parent), gguf_file=ours.gguf_path.name, dtype=torch.float32
    ).eval()
    prompt = PROMPTS[2]
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(_logits(ours.model, [prompt]), expected, rtol=1e-4, atol=1e-4)


def test_int8_quantizes_every_linear_of_any_model(tiny_model_factory):
    for tied in (False, True):
        path = tiny_model_factory(tie_word_embeddings=tied)
        served = load_model(path, device="cpu", dtype="float32", quantization="int8")
        model = served.model
        assert served.quantization == "int8"
        linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
        assert len(linears) == 4 * model.config.num_layers + 1  # and the head
        assert all(m.weight_q.format == "Q8_0" for m in linears)
        assert isinstance(model.model.embed_tokens, QuantizedEmbedding) == tied
        plain = load_model(path, device="cpu", dtype="float32", quantization="none").model
        assert _kl(_logits(plain), _logits(model)) < 0.01


def test_int8_blocks_are_symmetric_and_round_to_nearest():
    weight = torch.tensor([[1.0, -0.5, 0.25, 0.0] * 8, [127.0] + [-1.0] * 31])
    quantized = quantize_int8(weight)
    assert quantized.shape == (2, 32) and quantized.format == "Q8_0"
    assert quantized.rows.shape == (2, 34)  # one block a row: fp16 scale + 32 int8
    back = quantized.dequantize()
    assert torch.equal(back[1], weight[1])  # scale 1: every weight an integer
    assert torch.equal(back[0, :4], back[0, 4:8]) and back[0, 3] == 0
    assert (back[0] - weight[0]).abs().max() <= 0.5 / 127 + 1e-3  # half a step


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_are_the_same_alone_and_in_a_batch(tiny_gguf_path, dtype):
    """What keeps greedy speculation and seeded sampling exact on a quantized target."""
    model = load_model(tiny_gguf_path, device="cpu", dtype=dtype).model
    together = _logits(model)
    start = 0
    for prompt in PROMPTS:
        alone = _logits(model, [prompt])
        assert torch.equal(alone, together[start : start + len(prompt)])
        start += len(prompt)


def test_the_one_call_decoder_runs_quantized_layers_bit_for_bit(tiny_gguf_path):
    fused = SimplePagedRunner(load_model(tiny_gguf_path, dtype="bfloat16").model, num_blocks=64)
    plain = SimplePagedRunner(load_model(tiny_gguf_path, dtype="bfloat16").model, num_blocks=64)
    assert fused.model.model.fused is not None
    plain.model.model.fused = None
    assert fused.generate_greedy(PROMPTS, 20) == plain.generate_greedy(PROMPTS, 20)
    for runner in (fused, plain):
        runner.add_sequence(9)
    assert torch.equal(
        fused.step([(9, PROMPTS[2])], all_logits=True),
        plain.step([(9, PROMPTS[2])], all_logits=True),
    )


def test_other_gguf_types_are_dequantized_and_said_so(tiny_gguf_factory, caplog):
    path = tiny_gguf_factory("Q5_0", "Q8_0")
    with caplog.at_level(logging.INFO, logger="engine.models.gguf_weights"):
        model = load_model(path, device="cpu", dtype="float32").model
    assert "dequantized 15 Q5_0 tensors (no kernel serves them as stored)" in caplog.text
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, PackedLinear)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)


def test_without_the_kernels_auto_dequantizes_and_int8_is_refused(
    tiny_gguf_path, tiny_model_dir, monkeypatch, caplog
):
    from engine.kernels.cpu import cpu_kernels_enabled

    with cpu_kernels_enabled(False), caplog.at_level(logging.INFO, logger="engine.loader"):
        served = load_model(tiny_gguf_path, device="cpu", dtype="float32")
        assert served.quantization == "none"
        assert "dequantized: the CPU kernels are unavailable" in caplog.text
        with pytest.raises(ValueError, match="quantization 'int8' runs on specserve's CPU kernels"):
            load_model(tiny_model_dir, device="cpu", dtype="float32", quantization="int8")


def test_a_bad_quantization_is_named():
    with pytest.raises(ValueError, match="quantization must be one of auto, none, int8, got 'q4'"):
        load_model(None, quantization="q4")
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="quantization must be one of 'auto', 'none', 'int8'"):
        EngineConfig(quantization="fp8")


# ---- speculation on a quantized target is exact against that target --------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", ["ngram", "draft", "hybrid"])
def test_greedy_speculation_on_a_quantized_target_is_its_own_greedy_output(
    tiny_gguf_path, spec_draft_dirs, method, dtype
):
    from tests.engine.test_spec_decode import _workload

    reference = run_to_completion(make_engine(tiny_gguf_path, dtype=dtype), _workload(None))
    engine = make_engine(
        tiny_gguf_path,
        dtype=dtype,
        speculative_method=method,
        draft_model=spec_draft_dirs.get(method),
        speculative_disable_batch_size=64,
    )
    for k in (1, 4):
        results = run_to_completion(engine, _workload(k))
        for request_id, ref in reference.items():
            assert results[request_id]["token_ids"] == ref["token_ids"], (k, request_id)
        assert_all_blocks_released(engine)
    assert engine.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft", "hybrid"])
def test_a_seeded_request_on_a_quantized_target_is_the_same_alone_and_in_a_crowd(
    tiny_gguf_path, spec_draft_dirs, method
):
    from tests.engine.test_seeded import _alone, _crowd

    alone = _alone(tiny_gguf_path)
    engine = make_engine(
        tiny_gguf_path,
        speculative_method=method,
        draft_model=spec_draft_dirs.get(method),
        speculative_disable_batch_size=64,
        seed=3,
    )
    results = run_to_completion(engine, _crowd(None))
    for request_id, tokens in alone.items():
        assert results[request_id]["token_ids"] == tokens, request_id
    assert engine.stats.num_draft_tokens > 0
    assert_all_blocks_released(engine)


def test_a_read_only_cache_converts_into_the_temp_dir(
    tiny_gguf_path, tmp_path, monkeypatch, capsys
):
    """A container's baked cache is read-only: `--quantization none` on its GGUF still
    loads, converting into the temp dir (kept while /tmp lasts), and says so."""
    import tempfile
    from pathlib import Path

    from engine.models import gguf_convert

    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "baked"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    baked = gguf_convert.converted_dir(Path(tiny_gguf_path)).parent
    writable = gguf_convert._writable
    monkeypatch.setattr(gguf_convert, "_writable", lambda d: d != baked and writable(d))
    out = gguf_convert.ensure_converted(Path(tiny_gguf_path), weights=True)
    assert out.is_relative_to(tmp_path / "tmp") and (out / "model.safetensors").exists()
    assert "is read-only; converting into" in capsys.readouterr().err
    assert gguf_convert.ensure_converted(Path(tiny_gguf_path), weights=True) == out
    assert "converting" not in capsys.readouterr().err  # found, not converted again
    loaded = load_model(tiny_gguf_path, device="cpu", quantization="none")
    assert loaded.quantization == "none"


@pytest.mark.parametrize("kernels", ["native", "amx"])
def test_no_batch_invariance_puts_crowded_calls_on_bf16_tiles(tiny_gguf_path, kernels, request):
    """``batch_invariant=False`` (``--no-batch-invariance``) sets the kernels' rule (by
    format: Q4 calls from 16 rows, Q8_0 from 32) for the process, and an engine with
    the default sets it back to never; a crowd of requests, whose prompts share steps
    of 32 rows and more, is served to the end with every block released: on the
    native kernels (on bf16 tiles where the CPU has AMX-BF16, else with the rule inert)
    and on AMX tiles (this CPU's, else emulated)."""
    from engine.io.sampling_params import SamplingParams
    from engine.kernels.quant import quant_ops

    if kernels == "amx":
        request.getfixturevalue("on_amx_tiles")
    ops = quant_ops()
    if ops is None:
        pytest.skip("no CPU kernels here")
    calls = ops.bf16_calls
    engine = make_engine(tiny_gguf_path, batch_invariant=False, dtype="bfloat16")
    try:
        prompts = {f"r{i}": [(7 * i + j) % 200 + 3 for j in range(20 + i)] for i in range(24)}
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        results = run_to_completion(
            engine, {0: [(rid, prompt, params) for rid, prompt in prompts.items()]}
        )
        assert all(len(results[rid]["token_ids"]) == 6 for rid in prompts)
        assert_all_blocks_released(engine)
        assert (ops.bf16_calls > calls) == ops.bf16_tiles
        if ops.bf16_tiles:
            assert ops.bf16_min_rows == -1
    finally:
        make_engine(tiny_gguf_path)
    assert ops.bf16_min_rows == 0
