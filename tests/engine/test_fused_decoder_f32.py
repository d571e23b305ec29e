"""The one-call decoder in float32 (issue 35, item 1): a model whose Linear layers are
all quantized (a .gguf as stored, the default configuration on CPUs without
AVX512-BF16) runs every layer in one C call at every kernel level this CPU executes,
the AVX2 level among them, and its logits are the layer-by-layer forward's bit for bit:
prefill chunks, decodes and verification-sized queries mixed in one batch, and greedy
output. A float32 model with float Linear layers stays layer by layer (its GEMMs are
oneDNN's)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kernels import cpu as cpu_mod
from engine.kernels import quant as quant_mod
from engine.kernels.cpu import CpuKernels, cpu_kernels
from engine.loader import load_model
from engine.models import layers as layers_mod
from engine.models.llama import LlamaDecoderLayer
from tests.engine.kernel_levels import runnable_levels
from tests.engine.simple_runner import SimplePagedRunner


@pytest.fixture(scope="module", params=runnable_levels())
def kernels(request) -> CpuKernels:
    if request.param == "native":
        found = cpu_kernels()
        if found is None:
            pytest.fail("CPU kernels failed to build; see the warning logged by cpu_kernels()")
        return found
    return CpuKernels(request.getfixturevalue("prebuilt_kernel_levels")[request.param])


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
    for chunks in steps:
        chunks = [(seq, [rng.randrange(vocab) for _ in range(n)]) for seq, n in chunks]
        before = calls["n"]
        ours = fused.step(chunks, all_logits=True)
        assert calls["n"] == before  # no Python layer ran: the one call did it all
        theirs = plain.step(chunks, all_logits=True)
        assert calls["n"] > before
        assert torch.equal(ours, theirs)


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
