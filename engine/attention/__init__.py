"""Paged KV cache allocation and attention backend selection.

KV cache layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``,
index 0 = K, 1 = V. Block 0 is the null block that pads block tables.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

from engine import envs
from engine.attention.metadata import (
    AttentionMetadata,
    build_attention_metadata,
    get_attention_metadata,
    set_attention_metadata,
)

ATTENTION_BACKENDS = ("torch", "xformers", "cpu")

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionMetadata",
    "allocate_kv_caches",
    "build_attention_metadata",
    "get_attention_backend",
    "get_attention_metadata",
    "kv_cache_bytes_per_block",
    "kv_pool_view",
    "set_attention_metadata",
]


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block costs across all layers (K and V)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * element_size


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """One zeroed allocation for every layer; returns per-layer views.

    Zeroed so the null block and unwritten slots hold finite values: masked keys still
    enter SDPA's matmul, and 0 * NaN would poison the output.
    """
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    pool = torch.empty(shape, dtype=dtype, device=device)
    if pool.device.type == "cpu" and envs.kv_hugepages():
        advise_huge_pages(pool)
    pool.zero_()  # after the advice: the pages are first touched here
    return list(pool.unbind(0))


_MADV_HUGEPAGE = 14


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back ``t``'s memory with 2 MB pages where it can (``MADV_HUGEPAGE``;
    transparent huge pages in their default ``madvise`` mode take only memory so marked),
    before the memory is first touched. The KV cache is read a block at a time from
    anywhere in it: with 4 KB pages each block-head's keys and values span several pages
    and a decode step misses the TLB at nearly every block (each miss a two-level walk
    under a hypervisor); with 2 MB pages one layer's cache is a few. Returns whether the
    advice was taken (False off Linux, or where THP is off)."""
    if not sys.platform.startswith("linux") or t.numel() == 0:
        return False
    page = 4096
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if end <= start:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.restype = ctypes.c_int
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise(start, end - start, _MADV_HUGEPAGE) == 0


def kv_pool_view(kv_caches: list[torch.Tensor]) -> torch.Tensor:
    """The per-layer caches of ``allocate_kv_caches`` as one view
    [num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim] of their allocation:
    one indexing op reaches a slot in every layer."""
    first = kv_caches[0]
    _, num_blocks, block_size, num_kv_heads, head_dim = first.shape
    layer_stride = first.numel()
    if any(c.data_ptr() != first.data_ptr() + i * layer_stride * first.element_size()
           for i, c in enumerate(kv_caches)):  # fmt: skip
        raise ValueError("the KV caches are not views of one allocation (allocate_kv_caches)")
    return first.as_strided(
        (len(kv_caches), 2, num_blocks * block_size, num_kv_heads, head_dim),
        (layer_stride, *first.view(2, num_blocks * block_size, num_kv_heads, head_dim).stride()),
    )


def get_attention_backend(name: str, device: torch.device | str):
    """Instantiate backend ``name`` ("torch", "xformers" or "cpu") for ``device``."""
    if name == "cpu":
        from engine.attention.cpu_backend import CpuAttentionBackend
        from engine.kernels.cpu import cpu_kernels

        kernels = cpu_kernels()
        if kernels is None:
            raise RuntimeError(
                "attention backend 'cpu' needs specserve's compiled CPU kernels, which are "
                "switched off (SPECSERVE_CPU_KERNELS=0) or failed to build (see the warning "
                "above); use --attn-backend torch"
            )
        return CpuAttentionBackend(torch.device(device), kernels)
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(torch.device(device))
    if name == "xformers":
        from engine.attention.xformers_backend import XFormersAttentionBackend

        return XFormersAttentionBackend(torch.device(device))
    raise ValueError(f"unknown attention backend {name!r}; choose one of {ATTENTION_BACKENDS}")


# How xformers_problem's answer starts when xformers is not installed at all (the loader
# falls back to torch without a warning then: a CPU-only or plain CUDA install).
XFORMERS_NOT_INSTALLED = "xformers is not installed"


@functools.cache
def xformers_problem(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """None when xformers' memory-efficient attention runs on ``device`` in ``dtype``;
    else one line saying why not. An importable xformers is not enough: a wheel built for
    another torch or CUDA imports fine and fails at its first call (its C++/CUDA
    extension does not load), so this runs one tiny attention call to find out."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return "needs a CUDA GPU"
    try:
        import xformers
        from xformers.ops import fmha
    except ImportError as exc:
        return f"{XFORMERS_NOT_INSTALLED} (pip install 'specserve[gpu]'): {exc}"
    problem = probe_fmha(fmha, torch.device(device), dtype)
    if problem is None:
        return None
    version = getattr(xformers, "__version__", "?")
    load_error = getattr(getattr(xformers, "_cpp_lib", None), "_cpp_library_load_exception", None)
    if load_error is not None:  # e.g. built for another torch: name the builds, one line
        problem = " ".join(str(load_error).split()) + "; " + problem
    return f"xformers {version} cannot run {dtype} attention here: {problem}"


def probe_fmha(fmha, device: torch.device, dtype: torch.dtype, head_dim: int = 64) -> str | None:
    """Run ``fmha.memory_efficient_attention_forward`` once with the mask this engine
    uses (two sequences, one query each over 3 and 5 padded keys, GQA groups): None if it
    runs, else the first line of its error."""
    try:
        q = torch.zeros(1, 2, 1, 2, head_dim, device=device, dtype=dtype)
        kv = torch.zeros(1, 16, 1, 2, head_dim, device=device, dtype=dtype)
        mask_cls = fmha.attn_bias.BlockDiagonalCausalWithOffsetPaddedKeysMask
        bias = mask_cls.from_seqlens(q_seqlen=[1, 1], kv_padding=8, kv_seqlen=[3, 5])
        fmha.memory_efficient_attention_forward(q, kv, kv, attn_bias=bias.to(device))
    except (NotImplementedError, RuntimeError, ValueError, TypeError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return lines[0] if lines else type(exc).__name__
    return None
