"""The one-call decoder in float32 (issue 35, item 1): a model whose Linear layers are
all quantized (a .gguf as stored, the default configuration on CPUs without
AVX512-BF16) runs every layer in one C call at every kernel level this CPU executes,
the AVX2 level among them, and its logits are the layer-by-layer forward's bit for bit:
prefill chunks, decodes and verification-sized queries mixed in one batch, and greedy
output. A float32 model with float Linear layers stays layer by layer (its GEMMs are
oneDNN's)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu as cpu_mod
from engine.kernels import quant as quant_mod
from engine.kernels.cpu import CpuKernels
from engine.loader import load_model
from engine.models import layers as layers_mod
from tests.engine.kernel_levels import kernels_at_level, runnable_levels
from tests.engine.simple_runner import SimplePagedRunner
from tests.engine.test_fused_decoder import check_one_call_matches_layers


@pytest.fixture(scope="module", params=runnable_levels())
def kernels(request) -> CpuKernels:
    return kernels_at_level(request)


@pytest.fixture()
def at_level(kernels, monkeypatch) -> CpuKernels:
    """Every layer of the process sees ``kernels`` (loads made after this use them)."""
    for module in (cpu_mod, layers_mod, quant_mod):
        monkeypatch.setattr(module, "cpu_kernels", lambda: kernels)
    return kernels


def _runners(model_path: str) -> tuple[SimplePagedRunner, SimplePagedRunner]:
    fused = SimplePagedRunner(load_model(model_path, dtype="float32").model, num_blocks=64)
    plain = SimplePagedRunner(load_model(model_path, dtype="float32").model, num_blocks=64)
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


def test_fp32_float_linear_layers_stay_layer_by_layer(tiny_model_dir, tiny_gguf_path):
    def fused_after_bind(path, **kwargs):
        loaded = load_model(path, **kwargs)
        SimplePagedRunner(loaded.model, num_blocks=8)
        return loaded.model.model.fused

    assert fused_after_bind(tiny_model_dir, dtype="float32") is None
    assert fused_after_bind(tiny_gguf_path, dtype="float32") is not None
    assert fused_after_bind(tiny_gguf_path, dtype="float32", attn_backend="torch") is None
