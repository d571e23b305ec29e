"""Map Hugging Face checkpoint names onto our fused Llama modules."""

from __future__ import annotations

import dataclasses
import mmap
from collections.abc import Iterable

import torch
from torch import nn

from engine import envs
from engine.kernels.cpu import CpuKernels, kernels_for
from engine.kernels.quant import QuantWeight, quant_ops
from engine.models.gguf_weights import QuantizedTensor
from engine.models.quant import install_quantized

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


def load_hf_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    preloaded: Iterable[str] = (),
) -> None:
    """Copy HF-named tensors into ``model``, fusing q/k/v and gate/up; ``preloaded``
    names parameters the model already holds (a module shared with another model). A
    ``QuantizedTensor`` (a GGUF tensor kept as stored, or ``--quantization int8``) goes
    into a quantized module (engine/models/quant.py) where every shard of its layer is
    quantized in one format, and is dequantized into the float layer otherwise."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    loaded = {f"{name}#None" for name in preloaded}
    quantized: dict[str, QuantizedTensor] = {}
    for hf_name, tensor in weights:
        if hf_name.endswith(_SKIPPED_SUFFIXES) or (tied and hf_name == "lm_head.weight"):
            continue
        if isinstance(tensor, QuantizedTensor):
            quantized[hf_name] = tensor
        else:
            _load_one(model, params, hf_name, tensor, loaded)
    if quantized:
        used = install_quantized(model, quantized, quant_ops(), model.model.norm.weight.dtype)
        for hf_name in sorted(set(quantized) - used):
            _load_one(model, params, hf_name, quantized[hf_name].dequantize(), loaded)
        params = dict(model.named_parameters(remove_duplicate=False))
    expected = {n for n in params if not (tied and n == "lm_head.weight")}
    _check_complete(model, expected, loaded)
    if can_pack_linears(model):
        pack_linears_for_cpu(model)


def _load_one(model, params, hf_name: str, tensor: torch.Tensor, loaded: set[str]) -> None:
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


class PackedLinear(nn.Module):
    """A CPU Linear whose weight is packed once, at load, for the GEMM that runs it.

    Where specserve's kernels are built for it (engine/kernels/cpu_kernels.c): any CPU
    with FMA (AVX2 and up), bf16 on vdpbf16ps or FMA (whichever the process picked),
    float32 on FMA. They stream the weights at
    close to the memory bandwidth for the few rows of a decode step, where oneDNN
    reaches about half of it, their rows never depend on each other (batch invariant
    by construction), and the one-call decoder runs the same kernel, so both forwards
    compute the same bits. A float32 weight whose values are all bf16 numbers (a bf16
    checkpoint served in float32, as ``--dtype auto`` does on CPUs without native bf16)
    is stored as bf16: the same outputs from half the bytes.

    Otherwise (a CPU without FMA): oneDNN's blocked layout.
    Plain ``F.linear`` repacks the weight on every call; for the few rows of a decode
    or 1 + k verification step that costs more than the multiply."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().contiguous()
        self.bias = linear.bias
        self.kernels = linear_kernels(weight)
        if self.kernels is not None:
            storage = torch.bfloat16 if is_bf16_exact(weight) else weight.dtype
            self.packed_weight = self.kernels.pack_linear_weight(weight, storage)
        else:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight)

    @property
    def storage(self) -> torch.dtype:
        """The dtype the packed weight is kept in."""
        return self.packed_weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        bias = None if self.bias is None else self.bias.detach()
        if self.kernels is not None:
            return self.kernels.linear(x, self.packed_weight, bias, self.out_features)
        rows = x.shape[0]
        padded = row_bucket(rows)
        if padded != rows:
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
        out = torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed_weight, bias, "none", [], ""
        )
        return out if padded == rows else out[:rows]


def linear_kernels(weight: torch.Tensor) -> CpuKernels | None:
    """The kernels when they run Linear layers of ``weight``'s dtype, else None."""
    kernels = kernels_for(weight.device, weight.dtype)
    return kernels if kernels is not None and kernels.has_linear(weight.dtype) else None


def is_bf16_exact(weight: torch.Tensor) -> bool:
    """Whether a float32 weight's values are all bf16 numbers (its low 16 bits zero), so
    stored as bf16 it loses nothing."""
    if weight.dtype is not torch.float32:
        return False
    return not bool((weight.view(torch.int32) & 0xFFFF).any())


def row_bucket(rows: int) -> int:
    """Round a row count up so that at most 4 sizes per octave (and every size below 8)
    reach oneDNN, wasting under 25%. oneDNN compiles and caches a kernel per input
    shape; with every possible batch size that cache grew a serving process by
    hundreds of MiB before it filled up (seen in the soak test)."""
    step = 1 << max(0, rows.bit_length() - 3)
    return -(-rows // step) * step


def can_pack_linears(model: nn.Module) -> bool:
    weight = model.model.norm.weight
    if not envs.cpu_weight_packing() or weight.device.type != "cpu":
        return False
    if linear_kernels(weight) is not None:
        return True
    if not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if weight.dtype == torch.bfloat16:  # fast only with native bf16 instructions
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


def pack_linears_for_cpu(model: nn.Module) -> None:
    """Swap every nn.Linear for a PackedLinear (CPU, fp32 or bf16; specserve's Linear
    kernel or oneDNN available)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))


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


# Weights smaller than this stay where they are (norms, biases): what they cost the TLB
# is nothing beside a layer's matrices.
_HUGE_PAGE_MIN_BYTES = 64 * 1024
_HUGE_PAGE = 2 * 1024 * 1024


def weights_on_huge_pages(model: nn.Module) -> int:
    """Move a CPU model's large weights (Linear and embedding matrices, packed, quantized
    or plain) into one allocation advised onto 2 MB pages (``MADV_HUGEPAGE``) before it
    is first touched; returns the bytes moved (0 where nothing was, or Linux took no
    advice). A decode step streams every weight once: on 4 KB pages that is a TLB miss
    every 4 KB, each a page walk under a hypervisor; on 2 MB pages a batch-1 decode step
    took 0.87-0.95x the time (a Zen 4, 2026-12-07, docs/benchmarks.md). Only for
    a model no other holds pointers into yet: the one-call decoder takes its weights'
    addresses when the KV caches are bound, after this. Tensors shared by two modules
    (a tied head) stay shared."""
    from engine.attention import advise_huge_pages

    owners, sizes = _large_weights(model)
    total = sum(-(-nbytes // 4096) * 4096 for nbytes in sizes.values())  # each 4 KB aligned
    if not total:
        return 0
    arena = huge_page_arena(total)
    if not advise_huge_pages(arena):
        return 0
    offset = 0
    for ptr, held_by in owners.items():
        module, name = held_by[0]
        old = _held(module, name)
        view = arena[offset : offset + sizes[ptr]].view(old.dtype).view(old.shape).copy_(old)
        offset += -(-sizes[ptr] // 4096) * 4096
        del old  # each tensor moved and let go before the next: no second copy of the model
        replaced: dict[int, QuantWeight] = {}  # a QuantWeight two modules hold stays one
        for module, name in held_by:
            if name == "weight_q":
                weight = module.weight_q
                if id(weight) not in replaced:
                    replaced[id(weight)] = dataclasses.replace(weight, data=view)
                module.weight_q = replaced[id(weight)]
            elif name == "packed_weight":
                module.packed_weight = view
            else:
                getattr(module, name).data = view
    return total


def huge_page_arena(nbytes: int) -> torch.Tensor:
    """nbytes (uint8) of a private anonymous mapping of its own, 2 MB aligned and never
    touched, for ``advise_huge_pages`` before anything is written: malloc may hand out
    pages already in use (4 KB ones, which the advice does not change), and a shared
    mapping is shmem, which the advice does not cover. The tensor keeps it alive."""
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    arena = torch.frombuffer(mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=private), dtype=torch.uint8)
    start = -(-arena.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE - arena.data_ptr()
    return arena[start : start + nbytes]


def _large_weights(
    model: nn.Module,
) -> tuple[dict[int, list[tuple[nn.Module, str]]], dict[int, int]]:
    """weights_on_huge_pages' tensors, by address: who holds each (module, attribute),
    and its bytes. Addresses only: a tensor held here would outlive its move."""
    from engine.models.quant import QuantizedEmbedding, QuantizedLinear

    owners: dict[int, list[tuple[nn.Module, str]]] = {}  # data_ptr -> (module, attribute)
    sizes: dict[int, int] = {}
    for module in model.modules():
        held = [(name, p.data) for name, p in module.named_parameters(recurse=False)]
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            held.append(("weight_q", module.weight_q.data))
        packed = getattr(module, "packed_weight", None)
        if isinstance(packed, torch.Tensor):
            held.append(("packed_weight", packed))
        for name, t in held:
            nbytes = t.numel() * t.element_size()
            if (
                t.device.type == "cpu"
                and t.layout is torch.strided
                and not t.is_mkldnn
                and t.is_contiguous()
                and nbytes >= _HUGE_PAGE_MIN_BYTES
            ):
                owners.setdefault(t.data_ptr(), []).append((module, name))
                sizes[t.data_ptr()] = nbytes
    return owners, sizes


def _held(module: nn.Module, name: str) -> torch.Tensor:
    if name == "weight_q":
        return module.weight_q.data
    if name == "packed_weight":
        return module.packed_weight
    return getattr(module, name).data
