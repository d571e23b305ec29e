"""Quantized Linear layers on the CPU kernels (quant_kernels.c): GGUF Q4_0, Q4_1 and
Q8_0 weights packed once for the kernel, activations quantized to int8 per row and
32-block at every call, one fp32 accumulator per output (batch invariant).

Every wrapper checks what it is given (format, dtypes, shapes, the packed buffer's size)
and raises ValueError naming the argument; C checks ids against the rows it has. A
misuse never reaches C out of bounds.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from engine.kernels.cpu import _I32, _I64, _P, _check_float, cpu_kernels

__all__ = [
    "QuantWeight",
    "BLOCK",
    "FORMATS",
    "GGUF_BLOCK_BYTES",
    "QuantOps",
    "format_id",
    "format_name",
    "quant_ops",
]

BLOCK = 32  # weights per quantization block
# GGUF's formats the kernels serve as stored: name -> GGML type id
FORMATS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
_NAMES = {v: k for k, v in FORMATS.items()}
# Bytes of one GGUF block of 32 weights: fp16 scale (+ fp16 min for Q4_1) + quants
GGUF_BLOCK_BYTES = {2: 18, 3: 20, 8: 34}


def format_id(name: str) -> int:
    if name not in FORMATS:
        raise ValueError(f"quantized format must be one of {', '.join(FORMATS)}, got {name!r}")
    return FORMATS[name]


def format_name(fmt: int) -> str:
    if fmt not in _NAMES:
        raise ValueError(f"unknown quantized format id {fmt} (known: {sorted(_NAMES)})")
    return _NAMES[fmt]


_SUFFIX = {torch.float32: "", torch.bfloat16: "_bf16"}


@dataclass(frozen=True)
class QuantWeight:
    """An [n, k] weight packed for the kernels (``QuantOps.pack``): the buffer and what
    it holds travel together, so a call can never read it as another shape."""

    data: torch.Tensor  # uint8 [packed_bytes(fmt, n, k)], the kernel's tile layout
    fmt: int  # GGML type id
    n: int  # output features (rows of the weight)
    k: int  # input features, a multiple of 32

    @property
    def format(self) -> str:
        return format_name(self.fmt)


class QuantOps:
    """Typed wrappers over the quantized entry points of a loaded kernel library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.specserve_quant_lanes.restype, lib.specserve_quant_lanes.argtypes = _I32, []
        lib.specserve_quant_path.restype, lib.specserve_quant_path.argtypes = ctypes.c_char_p, []
        packed_bytes = lib.specserve_quant_packed_bytes
        packed_bytes.restype, packed_bytes.argtypes = _I64, [_I32, _I64, _I64]
        pack = lib.specserve_quant_pack
        pack.restype, pack.argtypes = ctypes.c_int, [_I32, _P, _I64, _I64, _I64, _P]
        self._packed_bytes, self._pack = packed_bytes, pack
        self._linear, self._embed = {}, {}
        for dtype, suffix in _SUFFIX.items():
            linear = getattr(lib, "specserve_quant_linear" + suffix)
            linear.restype = ctypes.c_int
            linear.argtypes = [_P, _P, _I64, _P, _I32, _P, _I64, _I64, _I64, _I32]
            embed = getattr(lib, "specserve_quant_embed" + suffix)
            embed.restype, embed.argtypes = ctypes.c_int, [_P, _P, _I64, _P, _I32, _I64, _I64]
            self._linear[dtype], self._embed[dtype] = linear, embed
        amx = lib.specserve_quant_amx_min_rows
        amx.restype, amx.argtypes = _I32, [_I32]
        self._amx_min_rows = amx
        calls = lib.specserve_quant_amx_calls
        calls.restype, calls.argtypes = _I64, []
        self._amx_calls = calls
        # (absent from the builds of revisions before it, which bench_kernel_ab.py loads)
        bf16_rows = getattr(lib, "specserve_quant_bf16_min_rows", None)
        if bf16_rows is not None:
            bf16_rows.restype, bf16_rows.argtypes = _I32, [_I32]
            lib.specserve_quant_bf16_calls.restype = _I64
            lib.specserve_quant_bf16_calls.argtypes = []
        self._bf16_min_rows = bf16_rows
        self._bf16_calls = getattr(lib, "specserve_quant_bf16_calls", None)
        tiles = getattr(lib, "specserve_quant_bf16_tiles", None)
        if tiles is not None:
            tiles.restype, tiles.argtypes = _I32, []
        #: Whether this process runs the bf16 tile path where the rule asks for it (built
        #: with AMX-BF16 and the tiles lent by Linux); without it the rule is inert.
        self.bf16_tiles = tiles is not None and bool(tiles())
        # Outputs per packed tile, and which of the kernel's paths this build runs.
        self.lanes = int(lib.specserve_quant_lanes())
        self.path = lib.specserve_quant_path().decode()

    @property
    def amx_min_rows(self) -> int:
        """The fewest rows a call needs to run on AMX tiles: -1 by format (what measured
        faster), 0 never (and always 0 in a build without the AMX path). Both paths give
        the same bits; tests and benchmarks set it to compare them."""
        return int(self._amx_min_rows(-2))

    @property
    def amx_calls(self) -> int:
        """Calls that ran on AMX tiles so far, in this process."""
        return int(self._amx_calls())

    def set_amx_min_rows(self, rows: int) -> None:
        if rows < -1:
            raise ValueError(f"amx_min_rows must be >= -1, got {rows}")
        self._amx_min_rows(rows)

    @property
    def bf16_min_rows(self) -> int:
        """The fewest rows a call needs to run on the AMX-BF16 tiles with its weights
        dequantized to bf16 (not batch invariant: other bits than the int8 paths): -1 by
        format, 0 never (the default, and always in a build without AMX-BF16)."""
        return 0 if self._bf16_min_rows is None else int(self._bf16_min_rows(-2))

    @property
    def bf16_calls(self) -> int:
        """Calls (a thread's share of one) that ran on the bf16 tiles so far."""
        return 0 if self._bf16_calls is None else int(self._bf16_calls())

    def set_bf16_min_rows(self, rows: int) -> None:
        if rows < -1:
            raise ValueError(f"bf16_min_rows must be >= -1, got {rows}")
        if self._bf16_min_rows is not None:
            self._bf16_min_rows(rows)

    def packed_bytes(self, fmt: int, n: int, k: int) -> int:
        """Bytes of a packed [n, k] weight of format ``fmt``."""
        format_name(fmt)
        if n < 1 or k < 1 or k % BLOCK:
            raise ValueError(f"a quantized weight is [n >= 1, k a multiple of 32], got [{n}, {k}]")
        return int(self._packed_bytes(fmt, n, k))

    def pack(self, fmt: int, rows: torch.Tensor, k: int) -> QuantWeight:
        """GGUF rows (uint8 [n, k / 32 * block bytes]: each row's blocks as stored) in the
        kernel's tile layout."""
        if rows.dtype is not torch.uint8 or not rows.is_cpu or rows.dim() != 2:
            raise ValueError(
                f"rows must be a 2-D uint8 CPU tensor, got {rows.dtype} {tuple(rows.shape)}"
            )
        n = rows.shape[0]
        size = self.packed_bytes(fmt, n, k)
        row_bytes = k // BLOCK * GGUF_BLOCK_BYTES[fmt]
        if rows.shape[1] != row_bytes:
            raise ValueError(
                f"rows {tuple(rows.shape)} are not {format_name(fmt)} rows of {k} weights: "
                f"each must be {row_bytes} bytes"
            )
        rows = rows.contiguous()
        packed = torch.empty(size, dtype=torch.uint8)
        if self._pack(fmt, rows.data_ptr(), row_bytes, n, k, packed.data_ptr()):
            raise ValueError(f"cannot pack {format_name(fmt)} [{n}, {k}]")
        return QuantWeight(packed, fmt, n, k)

    def linear(
        self,
        x: torch.Tensor,  # [m, k] float32 or bfloat16, rows may be strided
        weight: QuantWeight,  # [n, k]
        bias: torch.Tensor | None,  # [n], x's dtype
    ) -> torch.Tensor:  # [m, n] in x's dtype: x @ W^T + bias, each row independent of m
        dtype = _check_float("x", x, 2, rows_strided=True)
        m, k = x.shape
        if k != weight.k:
            raise ValueError(f"x [{m}, {k}] does not fit a [{weight.n}, {weight.k}] weight")
        self._check_packed(weight)
        packed, fmt, out_features = weight.data, weight.fmt, weight.n
        if bias is not None:
            _check_float("bias", bias, 1, (dtype, "x"))
            if bias.shape[0] != out_features:
                raise ValueError(f"bias [{bias.shape[0]}] != out_features {out_features}")
        out = x.new_empty(m, out_features)
        status = self._linear[dtype](
            out.data_ptr(),
            x.data_ptr(),
            x.stride(0) if m > 1 else k,
            packed.data_ptr(),
            fmt,
            None if bias is None else bias.data_ptr(),
            m,
            out_features,
            k,
            torch.get_num_threads(),
        )
        if status == 3:
            raise MemoryError("the quantized Linear kernel could not allocate its scratch")
        if status:
            raise ValueError(f"the quantized Linear kernel refused {format_name(fmt)} [.., {k}]")
        return out

    def embed(
        self,
        ids: torch.Tensor,  # [num_ids] int64
        weight: QuantWeight,  # [n, k]: the embedding (and a tied head)
        dtype: torch.dtype,
    ) -> torch.Tensor:  # [num_ids, k]: rows ``ids`` dequantized, in ``dtype``
        if ids.dtype is not torch.int64 or not ids.is_cpu or ids.dim() != 1:
            raise ValueError(f"ids must be a 1-D int64 CPU tensor, got {ids.dtype} {ids.shape}")
        if dtype not in _SUFFIX:
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
        self._check_packed(weight)
        packed, fmt, n, k = weight.data, weight.fmt, weight.n, weight.k
        ids = ids.contiguous()
        out = torch.empty(ids.shape[0], k, dtype=dtype)
        status = self._embed[dtype](
            out.data_ptr(), ids.data_ptr(), ids.shape[0], packed.data_ptr(), fmt, n, k
        )
        if status == 2:
            raise ValueError(f"a token id outside 0..{n - 1}")
        if status:
            raise ValueError(f"the quantized embedding refused {format_name(fmt)} [{n}, {k}]")
        return out

    def _check_packed(self, weight: QuantWeight) -> None:
        packed, fmt, n, k = weight.data, weight.fmt, weight.n, weight.k
        expected = self.packed_bytes(fmt, n, k)
        if packed.dtype is not torch.uint8 or not packed.is_cpu or not packed.is_contiguous():
            raise ValueError(f"packed must be a dense uint8 CPU tensor, got {packed.dtype}")
        if packed.numel() != expected:
            raise ValueError(
                f"packed holds {packed.numel()} bytes, not a packed {format_name(fmt)} "
                f"[{n}, {k}] weight ({expected} bytes)"
            )


def quant_ops() -> QuantOps | None:
    """The quantized kernels of the process-wide CPU kernels, or None without them."""
    kernels = cpu_kernels()
    if kernels is None:
        return None
    ops = getattr(kernels, "_quant_ops", None)
    if ops is None:
        ops = kernels._quant_ops = QuantOps(kernels.lib)
    return ops
