"""Building blocks of the Llama family: RMSNorm, rotary embeddings, SiLU-and-multiply.

On CPU in float32 and bfloat16 each runs as one call into specserve's compiled kernels
(engine/kernels/cpu_kernels.c) when they are available; otherwise, and on every other
device and dtype, as torch ops. In float32 both give the same values up to fp32
rounding; in bfloat16 the kernels round where the torch ops below round, so they give
the same bfloat16 values but for rare one-ulp differences (engine/kernels/cpu.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu import cpu_kernels, kernels_for


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``, ``(norm(x + residual), x + residual)``: the
        residual add of the previous sub-layer fused in. The kernel path updates
        ``residual`` in place, so callers must own it."""
        kernels = kernels_for(x.device, x.dtype)
        if kernels is not None and x.is_contiguous() and self.weight.dtype is x.dtype:
            out = kernels.rms_norm(x, self.weight.detach(), self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        if x.dtype == torch.float32:  # one fused kernel, bit-identical to the formula below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 like the reference implementation, then scale in model dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, with "linear" or "llama3" scaling applied."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
    )
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin for every position, computed once (lazily, on the weights' device)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: Any) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self._cos_sin: torch.Tensor | None = None  # [max_positions, 2, head_dim // 2]

    def for_positions(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeBatch:
        """The rotation of one step's tokens, shared by every layer."""
        table = self._cos_sin
        if table is None or table.device != positions.device or table.dtype != dtype:
            table = self._cos_sin = self._build(positions.device, dtype)
        if kernels_for(table.device, table.dtype) is not None and positions.is_contiguous():
            return RopeBatch(table, positions, None, None)
        # In the model's dtype on both paths: torch's (and transformers') bf16 rotary
        # multiplies by bf16 cos / sin, and the kernel rounds as it does.
        cos_sin = table.index_select(0, positions)  # [num_tokens, 2, head_dim // 2]
        return RopeBatch(table, positions, cos_sin[:, 0:1], cos_sin[:, 1:2])

    def _build(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        pos = torch.arange(self.max_positions, dtype=torch.int64, device=device).float()
        freqs = pos[:, None] * self.inv_freq.to(device)[None, :]  # fp32, as the reference
        return torch.stack([freqs.cos(), freqs.sin()], dim=1).to(dtype)


class RopeBatch:
    """Rotates the q and k heads of one step's fused qkv projections."""

    __slots__ = ("table", "positions", "cos", "sin")

    def __init__(self, table, positions, cos, sin) -> None:
        self.table = table  # [max_positions, 2, head_dim // 2]
        self.positions = positions  # [num_tokens] int64
        self.cos = cos  # [num_tokens, 1, head_dim // 2], or None on the kernel path
        self.sin = sin

    def __call__(
        self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:  # q [n, heads, hd], k [n, kv_heads, hd]
        """qkv: [num_tokens, (heads + 2 * kv_heads) * head_dim]. The kernel path rotates
        in place and returns views; the torch path returns new tensors."""
        rotated = num_heads + num_kv_heads
        if self.cos is None:
            cpu_kernels().rope(qkv, self.positions, self.table, rotated)
        # q and k together: they are adjacent in the fused output
        qk = qkv[:, : rotated * head_dim].view(qkv.shape[0], rotated, head_dim)
        if self.cos is not None:
            qk = apply_rope(qk, self.cos, self.sin)
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
        return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [n, 2 * inter] -> [n, inter]
    kernels = kernels_for(x.device, x.dtype)
    if kernels is not None and x.is_contiguous():
        return kernels.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Rotate-half convention (HF layout: first half real, second half imaginary)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
