"""The one-call decoder in float32 (issue 35, item 1): a model whose Linear layers are
all quantized (a .gguf as stored, the default configuration on CPUs without
AVX512-BF16), or float (a checkpoint served in float32; a bf16 one keeps its Linear
weights as bf16), runs every layer in one C call at every kernel level this CPU
executes, the AVX2 level among them, and its logits are the layer-by-layer forward's
bit for bit: prefill chunks, decodes and verification-sized queries mixed in one batch,
and greedy output. At a level without FMA, float Linear layers stay on oneDNN, layer by
layer."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import CpuKernels
from engine.loader import load_model
from engine.models import weights as weights_mod
from engine.models.weights import PackedLinear
from tests.engine.kernel_levels import kernels_at_level, runnable_levels, use_kernels
from tests.engine.simple_runner import SimplePagedRunner
from tests.engine.test_fused_decoder import check_one_call_matches_layers


# the emulated AMX level too: quantized layers on AMX tiles
@pytest.fixture(scope="module", params=runnable_levels(emulated_amx=True))
def kernels(request) -> CpuKernels:
    return kernels_at_level(request)


@pytest.fixture()
def at_level(kernels, monkeypatch) -> CpuKernels:
    """Every layer of the process sees ``kernels`` (loads made after this use them)."""
    use_kernels(monkeypatch, kernels)
    return kernels


def _runners(
    model_path: str, kv_dtype: torch.dtype | None = None
) -> tuple[SimplePagedRunner, SimplePagedRunner]:
    fused, plain = (
        SimplePagedRunner(
            load_model(model_path, dtype="float32").model, num_blocks=64, kv_dtype=kv_dtype
        )
        for _ in range(2)
    )
    assert fused.model.model.fused is not None, "a quantized fp32 model runs in one call"
    plain.model.model.fused = None
    return fused, plain


def test_fp32_one_call_decoder_is_the_layer_by_layer_forward_bit_for_bit(
    at_level, tiny_gguf_path, monkeypatch
):
    fused, plain = _runners(tiny_gguf_path)
    assert fused.model.model.fused.dtype is torch.float32
    check_one_call_matches_layers(fused, plain, monkeypatch)


def test_fp32_greedy_output_is_the_same_in_one_call_or_not(at_level, tiny_gguf_path):
    fused, plain = _runners(tiny_gguf_path)
    prompts = [[5, 6, 7, 8, 9], [100, 3], list(range(20, 60))]
    assert fused.generate_greedy(prompts, 24) == plain.generate_greedy(prompts, 24)


@pytest.mark.parametrize("checkpoint", ["gguf", "fp32"])
def test_fp32_over_a_bf16_cache_in_one_call_is_the_layer_by_layer_forward(
    at_level, tiny_gguf_path, tiny_model_dir, checkpoint, monkeypatch
):
    """--kv-cache-dtype bfloat16: a float32 model over a bf16 KV cache runs in one call
    (specserve_decoder_layers_f32_bf16kv), bit for bit the layer-by-layer forward on the
    same cache dtype; and the cache changes the logits a little, not the model."""
    if checkpoint == "fp32" and not at_level.has_f32_linear:
        pytest.skip("a level without FMA: float Linear layers run on oneDNN, layer by layer")
    path = tiny_gguf_path if checkpoint == "gguf" else tiny_model_dir
    fused, plain = _runners(path, torch.bfloat16)
    assert fused.model.model.fused.kv_dtype is torch.bfloat16
    assert fused.model.model.layers[0].self_attn.kv_cache.dtype is torch.bfloat16
    check_one_call_matches_layers(fused, plain, monkeypatch)
    prompts = [[5, 6, 7, 8, 9], [100, 3], list(range(20, 60))]
    assert fused.generate_greedy(prompts, 16) == plain.generate_greedy(prompts, 16)
    full, _ = _runners(path)
    for runner in (fused, full):
        runner.add_sequence(99)
    a = fused.step([(99, list(range(30, 70)))], all_logits=True)
    b = full.step([(99, list(range(30, 70)))], all_logits=True)
    assert not torch.equal(a, b)  # the cache is bf16: K/V were rounded
    # bf16 keeps ~3 significant digits; a random tiny model amplifies them to ~2%
    assert float((a - b).norm() / b.norm()) < 0.05


def _fused_after_bind(path, **kwargs):
    loaded = load_model(path, **kwargs)
    SimplePagedRunner(loaded.model, num_blocks=8)
    return loaded.model.model.fused


def test_fp32_float_linear_layers_run_in_one_call_where_the_kernel_is_built(
    at_level, tiny_model_dir, tiny_gguf_path
):
    fused = _fused_after_bind(tiny_model_dir, dtype="float32")
    assert (fused is not None) == at_level.has_f32_linear
    assert _fused_after_bind(tiny_gguf_path, dtype="float32") is not None
    assert _fused_after_bind(tiny_gguf_path, dtype="float32", attn_backend="torch") is None


@pytest.mark.parametrize("checkpoint", ["fp32", "bf16"])
def test_fp32_float_model_in_one_call_is_the_layer_by_layer_forward(
    at_level, tiny_model_dir, tiny_bf16_checkpoint, checkpoint, monkeypatch
):
    if not at_level.has_f32_linear:
        pytest.skip("a level without FMA: float Linear layers run on oneDNN, layer by layer")
    path = tiny_model_dir if checkpoint == "fp32" else tiny_bf16_checkpoint
    fused, plain = _runners(path)
    linears = [m for m in fused.model.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 4 * len(fused.model.model.layers) + 1
    storage = torch.float32 if checkpoint == "fp32" else torch.bfloat16
    assert all(m.storage is storage for m in linears)
    check_one_call_matches_layers(fused, plain, monkeypatch)
    prompts = [[5, 6, 7, 8, 9], [100, 3], list(range(20, 60))]
    assert fused.generate_greedy(prompts, 16) == plain.generate_greedy(prompts, 16)


def test_bf16_storage_changes_no_bit_of_the_logits(at_level, tiny_bf16_checkpoint, monkeypatch):
    """A bf16 checkpoint served in float32: its Linear weights kept as bf16 (half the
    bytes) give the logits that keeping them as float32 gives, bit for bit."""
    if not at_level.has_f32_linear:
        pytest.skip("a level without FMA: float Linear layers run on oneDNN")
    halved = SimplePagedRunner(
        load_model(tiny_bf16_checkpoint, dtype="float32").model, num_blocks=64
    )
    monkeypatch.setattr(weights_mod, "is_bf16_exact", lambda weight: False)
    full = SimplePagedRunner(load_model(tiny_bf16_checkpoint, dtype="float32").model, num_blocks=64)
    assert halved.model.lm_head.storage is torch.bfloat16
    assert full.model.lm_head.storage is torch.float32
    for runner in (halved, full):
        runner.add_sequence(0)
        runner.add_sequence(1)
    chunks = [(0, list(range(3, 40))), (1, [7, 8, 9])]
    assert torch.equal(halved.step(chunks, all_logits=True), full.step(chunks, all_logits=True))
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60))]
    assert halved.generate_greedy(prompts, 16) == full.generate_greedy(prompts, 16)


def test_bf16_model_in_one_call_at_every_level_with_fma(at_level, tiny_model_dir, monkeypatch):
    """bf16 Linear layers run on the FMA kernel wherever there is FMA (AVX2 included,
    where they were oneDNN's): the bf16 model runs in one call, bit for bit its layer
    loop, at each level."""
    loads = [load_model(tiny_model_dir, dtype="bfloat16").model for _ in range(2)]
    fused, plain = (SimplePagedRunner(model, num_blocks=64) for model in loads)
    assert (fused.model.model.fused is not None) == at_level.has_bf16_linear
    if not at_level.has_bf16_linear:
        return
    plain.model.model.fused = None
    check_one_call_matches_layers(fused, plain, monkeypatch)


def test_wide_layers_in_one_call_at_every_level(at_level, tiny_gguf_factory, monkeypatch):
    """Linear layers wide enough that the team hands out their last quarter of output
    tiles several groups a take at every level (gate_up's 4,160 outputs, the head's
    4,130): the one call is the layer-by-layer forward bit for bit."""
    fused, plain = _runners(tiny_gguf_factory(intermediate_size=2080, vocab_size=4130))
    check_one_call_matches_layers(fused, plain, monkeypatch)
