"""Map Hugging Face checkpoint names onto our fused Llama modules."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

# HF suffix -> (our module suffix, shard index); shards are stacked along dim 0 in order.
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def _shard_sizes(model: nn.Module, fused_name: str) -> list[int]:
    attn_or_mlp = model.get_submodule(fused_name.rsplit(".", 1)[0])
    if fused_name.endswith("qkv_proj"):
        return [attn_or_mlp.q_size, attn_or_mlp.kv_size, attn_or_mlp.kv_size]
    return [attn_or_mlp.intermediate_size, attn_or_mlp.intermediate_size]


def _target(name: str) -> tuple[str, int | None]:
    """Our parameter name and shard index (None = whole tensor) for an HF name."""
    module, _, kind = name.rpartition(".")  # kind: weight / bias
    for hf_suffix, (ours, shard) in _FUSED.items():
        if module.endswith(hf_suffix):
            return f"{module[: -len(hf_suffix)]}{ours}.{kind}", shard
    return name, None


def load_hf_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    expected = {n for n in params if not (tied and n == "lm_head.weight")}
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        if hf_name.endswith(_SKIPPED_SUFFIXES) or (tied and hf_name == "lm_head.weight"):
            continue
        name, shard = _target(hf_name)
        if name not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
        param = params[name]
        if shard is None:
            _copy(param.data, tensor, hf_name)
        else:
            sizes = _shard_sizes(model, name.rsplit(".", 1)[0])
            start = sum(sizes[:shard])
            _copy(param.data[start : start + sizes[shard]], tensor, hf_name)
        loaded.add(f"{name}#{shard}")
    _check_complete(model, expected, loaded)
    if model.lm_head.weight.device.type == "cpu":
        relayout_linears(model, input_major=True)


def relayout_linears(model: nn.Module, input_major: bool) -> None:
    """Store every Linear weight input-major ([in, out] in memory) or row-major.

    The shape stays [out, in]; only the memory order changes. Measured on a 2-core CPU
    (SmolLM2-135M, fp32): with one row per matmul (batch-1 decode) input-major is ~1.3x
    faster for the layers and 2x for the 49k-vocab lm_head; with 2-8 rows (1+k
    verification) row-major is ~1.2x faster; at 32 rows they tie. Input-major is the
    CPU default. A tied lm_head gets its own copy: the embedding lookup wants rows.
    """
    for module in model.modules():
        if isinstance(module, nn.Linear):
            weight = module.weight.detach()
            relaid = weight.t().contiguous().t() if input_major else weight.contiguous()
            module.weight = nn.Parameter(relaid, requires_grad=False)


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
    dst.copy_(src)


def _check_complete(model: nn.Module, expected: set[str], loaded: set[str]) -> None:
    missing = []
    for name in sorted(expected):
        module_name = name.rsplit(".", 1)[0]
        if module_name.endswith(("qkv_proj", "gate_up_proj")):
            shards = range(len(_shard_sizes(model, module_name)))
            missing += [f"{name}[{i}]" for i in shards if f"{name}#{i}" not in loaded]
        elif f"{name}#None" not in loaded:
            missing.append(name)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")
