"""Quantized weights in the model: Linear layers and the embedding on the quantized CPU
kernels (engine/kernels/quant.py).

``install_quantized`` swaps a model's Linear layers (q/k/v and gate/up fused as in the
float model) and its embedding for these modules where every shard of a layer is a
``QuantizedTensor`` of one format; a tied head shares the embedding's packed weight.
``quantize_int8`` makes Q8_0 blocks of a float weight (``--quantization int8``).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.kernels.quant import GGUF_BLOCK_BYTES, QuantOps, QuantWeight, format_id
from engine.models.gguf_weights import QuantizedTensor

logger = logging.getLogger(__name__)

# Fused module suffix -> its HF shards, in the order the fused weight stacks them.
FUSED_SHARDS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.down_proj": ("mlp.down_proj",),
}


class QuantizedLinear(nn.Module):
    """``x @ W^T + bias`` with W packed for the quantized kernel (int8 activations)."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None, ops: QuantOps) -> None:
        super().__init__()
        self.weight_q = weight
        self.in_features, self.out_features = weight.k, weight.n
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        bias = None if self.bias is None else self.bias.detach()
        return self.ops.linear(x, self.weight_q, bias)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.weight_q.format}"


class QuantizedEmbedding(nn.Module):
    """Rows of a quantized weight, dequantized at lookup (a tied one is the LM head)."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype, ops: QuantOps) -> None:
        super().__init__()
        self.weight_q = weight
        self.num_embeddings, self.embedding_dim = weight.n, weight.k
        self.dtype = dtype
        self.ops = ops

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, dim]
        return self.ops.embed(ids, self.weight_q, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} x {self.embedding_dim}, {self.weight_q.format}"


def install_quantized(
    model: nn.Module, tensors: dict[str, QuantizedTensor], ops: QuantOps, dtype: torch.dtype
) -> set[str]:
    """Swap in quantized modules for the entries of ``tensors`` (HF names) that make a
    whole module of one format; returns the HF names used. Shards of a fused layer in
    mixed formats stay for the float path (the caller dequantizes them)."""
    used: set[str] = set()
    for prefix, module in list(model.named_modules()):
        for fused, shards in FUSED_SHARDS.items():
            if not prefix.endswith("." + fused):
                continue
            base = prefix[: -len(fused)]
            names = [f"{base}{shard}.weight" for shard in shards]
            found = [tensors.get(name) for name in names]
            if any(t is None for t in found) or len({t.format for t in found}) != 1:
                continue
            rows = torch.cat([t.rows for t in found]) if len(found) > 1 else found[0].rows
            weight = ops.pack(found[0].fmt, rows, found[0].shape[1])
            bias = None if module.bias is None else module.bias.detach().clone()
            _replace(model, prefix, QuantizedLinear(weight, bias, ops))
            used.update(names)
    used |= _install_embedding_and_head(model, tensors, ops, dtype)
    return used


def _install_embedding_and_head(model, tensors, ops: QuantOps, dtype) -> set[str]:
    used = set()
    tied = bool(model.config.tie_word_embeddings)
    embedding = tensors.get("model.embed_tokens.weight")
    head = tensors.get("lm_head.weight")
    if embedding is not None:
        weight = ops.pack(embedding.fmt, embedding.rows, embedding.shape[1])
        model.model.embed_tokens = QuantizedEmbedding(weight, dtype, ops)
        used.add("model.embed_tokens.weight")
        if tied:
            model.lm_head = QuantizedLinear(weight, None, ops)
    if head is not None and not tied:
        model.lm_head = QuantizedLinear(ops.pack(head.fmt, head.rows, head.shape[1]), None, ops)
        used.add("lm_head.weight")
    return used


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def quantize_int8(weight: torch.Tensor) -> QuantizedTensor:
    """Q8_0 blocks of a float weight [n, k] (k a multiple of 32): per 32 weights an fp16
    scale d = max|w| / 127 and int8 round(w / d), symmetric."""
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // 32, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = (amax / 127.0).to(torch.float16)
    inverse = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(amax))
    quants = torch.round(blocks * inverse).clamp(-127, 127).to(torch.int8)
    rows = torch.cat([scale.view(torch.uint8), quants.view(torch.uint8)], dim=-1)
    assert rows.shape[-1] == GGUF_BLOCK_BYTES[format_id("Q8_0")]
    return QuantizedTensor("Q8_0", rows.reshape(n, -1).contiguous(), (n, k))


# The Linear weights of a Llama-family checkpoint, by HF name suffix.
_LINEAR_SUFFIXES = tuple(
    f"{shard}.weight" for shards in FUSED_SHARDS.values() for shard in shards
) + ("lm_head.weight",)


def int8_weights(weights, tied: bool):
    """``weights`` (HF name, float tensor) with every Linear weight made Q8_0 blocks
    (``quantize_int8``); with a tied head, the embedding too (it is the head). A weight
    whose input width is not a multiple of 32 stays float."""
    for name, tensor in weights:
        is_linear = name.endswith(_LINEAR_SUFFIXES) or (
            tied and name == "model.embed_tokens.weight"
        )
        if is_linear and tensor.dim() == 2 and tensor.shape[1] % 32 == 0:
            yield name, quantize_int8(tensor)
        else:
            yield name, tensor
