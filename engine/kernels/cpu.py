"""Load and call the CPU kernels in cpu_kernels.c (built by ``build.py``), in float32
and bfloat16.

Each wrapper takes float32 or bfloat16 tensors, all of one dtype per call, and calls
that dtype's C entry point; ``write_kv`` and ``paged_attention`` also take a float32
model's rows with a bfloat16 cache (``--kv-cache-dtype bfloat16``: K/V rounded to
bf16 as torch rounds them when written, widened back to fp32 when read). bfloat16 is
computed in fp32 and rounded where torch's bfloat16 ops round
(``layers.RMSNorm._norm``, ``x + residual``, ``apply_rope``, ``F.silu(gate) * up``):
the residual add, rotary and SiLU-and-mul give torch's bfloat16
results bit for bit. RMSNorm sums its squares in another order than torch, so about
one element in 10^5 lands on the other side of a rounding boundary (at most 2 ulps).
Attention accumulates in fp32 and rounds its output once (within half an ulp of the
exact result plus fp32 sums), where torch's SDPA rounds its probabilities to bfloat16
first; tests/engine/test_cpu_kernels.py states the tolerances.

``cpu_kernels()`` returns None, after logging one line, when the kernels are off
(``SPECSERVE_CPU_KERNELS=0``), there is no compiler, or the build fails; callers then
use their torch implementations. Every wrapper checks what it is given (dtype, device,
rank, shapes that must agree, strides) and raises ValueError naming the argument; the
C side checks every index it reads through (block ids, sequence ids, query ranges,
positions, slots) in the loops it runs anyway and returns a status. So a misuse can
never become an out-of-bounds access in C. The checks are attribute reads: these are
called several times per layer per step.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from engine import envs
from engine.kernels.build import KernelBuildError, build_library

__all__ = ["CpuKernels", "KernelBuildError", "build_library", "cpu_kernels", "kernels_for"]

logger = logging.getLogger(__name__)

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32
_F32 = ctypes.c_float
# Sizes cross as int64: ctypes truncates a Python int to a narrower type silently.
# Each name is the float32 entry point; name + "_bf16" the bfloat16 one, same arguments.
_SIGNATURES = {
    "specserve_paged_attention": (
        ctypes.c_int,
        [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _P, _P, _I64, _I64, _P, _I64]
        + [_I64, _I64, _I64, _I64, _I64, _F32, _I64, _I32, _P],
    ),
    "specserve_rms_norm": (None, [_P, _P, _P, _P, _I64, _I64, _F32, _I32]),
    "specserve_rope": (ctypes.c_int, [_P, _I64, _I64, _P, _P, _I64, _I64, _I64, _I32]),
    "specserve_write_kv": (ctypes.c_int, [_P, _I64, _P, _I64, _I64, _I64, _P, _P, _P, _I64]),
    "specserve_silu_and_mul": (None, [_P, _P, _I64, _I64, _I32]),
}


_FLOATS = (torch.float32, torch.bfloat16)
# The bf16 Linear kernels (cpu_kernels.c, BF16_LINEAR_*): name -> the C mode bit
BF16_LINEAR = {"vdpbf16ps": 1, "fma": 2, "amx": 4}
_PICK_ITERS = 100_000  # a few ms per instruction: the two peaks are 2x apart where measured
_SUFFIX = {torch.float32: "", torch.bfloat16: "_bf16"}
# float32 rows over a bfloat16 cache: these entry points + this suffix, same arguments
_BF16_KV = ("specserve_paged_attention", "specserve_write_kv")
_BF16_KV_SUFFIX = "_f32_bf16kv"


class _Entries:
    """One dtype's C entry points, by kernel name."""

    __slots__ = ("paged_attention", "rms_norm", "rope", "write_kv", "silu_and_mul")


class CpuKernels:
    """Typed wrappers over the loaded library. ``path`` must be safe to load (loading
    runs the library's constructors): what ``build_library`` returns."""

    def __init__(self, path: Path) -> None:
        # torch (imported above) has loaded libgomp.so.1; the library needs the same
        # soname, so the dynamic loader hands it torch's copy: one OpenMP thread pool.
        self.lib = ctypes.CDLL(str(path))
        self._entries: dict[torch.dtype, _Entries] = {}
        for dtype, suffix in _SUFFIX.items():
            entries = self._entries[dtype] = _Entries()
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(self.lib, name + suffix)
                fn.restype, fn.argtypes = restype, argtypes
                setattr(entries, name.removeprefix("specserve_"), fn)
        # (rows' dtype, cache's dtype) -> entries; the rows' own dtype for one dtype
        self._kv_entries: dict[tuple[torch.dtype, torch.dtype], _Entries] = {
            (dtype, dtype): entries for dtype, entries in self._entries.items()
        }
        mixed = self._kv_entries[(torch.float32, torch.bfloat16)] = _Entries()
        for name in _BF16_KV:
            restype, argtypes = _SIGNATURES[name]
            fn = getattr(self.lib, name + _BF16_KV_SUFFIX)
            fn.restype, fn.argtypes = restype, argtypes
            setattr(mixed, name.removeprefix("specserve_"), fn)
        self.path = path
        linear = self.lib.specserve_linear_bf16
        linear.restype, linear.argtypes = _I32, [_P, _P, _I64, _P, _P, _I64, _I64, _I64, _I32]
        self._linear_bf16 = linear
        linear = self.lib.specserve_linear_f32
        linear.restype = None
        linear.argtypes = [_P, _P, _I64, _P, _I32, _P, _I64, _I64, _I64, _I32]
        self._linear_f32 = linear
        modes = self.lib.specserve_bf16_linear_modes
        modes.restype, modes.argtypes = ctypes.c_int32, []
        self._set_bf16_linear = self.lib.specserve_set_bf16_linear
        self._set_bf16_linear.restype = ctypes.c_int32
        self._set_bf16_linear.argtypes = [ctypes.c_int32]
        team = self._decoder_team = self.lib.specserve_decoder_team
        team.restype, team.argtypes = ctypes.c_int32, [ctypes.c_int32]
        team_calls = self._decoder_team_calls = self.lib.specserve_decoder_team_calls
        team_calls.restype, team_calls.argtypes = _I64, []
        amx = self.lib.specserve_amx_tiles
        amx.restype, amx.argtypes = ctypes.c_int32, []
        # AMX tiles: 0 not in this build, 1 built but Linux did not lend them, 2 in use
        self.amx_tiles = int(amx())
        # A test build's tiles emulated in C (build.EMULATED_AMX_LEVEL); an older
        # source's library (a benchmark's base build) has no such function
        emulated = getattr(self.lib, "specserve_amx_emulated", None)
        if emulated is not None:
            emulated.restype, emulated.argtypes = ctypes.c_int32, []
        self.amx_emulated = bool(emulated is not None and emulated())
        tile_f32 = self.lib.specserve_linear_tile_f32
        tile_f32.restype, tile_f32.argtypes = ctypes.c_int32, []
        read = self.lib.specserve_read_gbps
        read.restype, read.argtypes = ctypes.c_double, [_P, _I64, _I32, _I32, _P]
        peak = self.lib.specserve_peak_gmacs
        peak.restype, peak.argtypes = ctypes.c_double, [_I32, _I64, _I32]
        self._read_gbps, self._peak_gmacs = read, peak
        mask = self.lib.specserve_mask_logits
        mask.restype, mask.argtypes = _I64, [_P, _I64, _I64, _I64, _P, _I64, _P, _I32]
        self._mask_logits = mask
        # Sampling's kernels; None in a library of an older source (the base build of
        # scripts/bench_kernel_ab.py loads, and its methods say what it lacks)
        self._sampling = {}
        for name, argtypes, restype in (
            ("specserve_row_argmax_f32", [_P, _P, _I64, _I64, _I64, _I32], None),
            ("specserve_exponential_rows", [_P, _I64, _I64, _I64, _P, _I32], None),
            ("specserve_sample_rows_f32", [_P, _P, _I64, _I64, _I64, _P, _I32], None),
            ("specserve_rows_nonfinite_f32", [_P, _P, _I64, _I64, _I64, _I32], _I64),
        ):
            fn = getattr(self.lib, name, None)
            if fn is not None:
                fn.restype, fn.argtypes = restype, argtypes
            self._sampling[name] = fn
        # Outputs per packed weight tile of the bf16 and the fp32 Linear kernels; 0 when
        # the library was built without either bf16 kernel (vdpbf16ps needs
        # AVX512-BF16, the FMA one FMA) or without FMA for fp32, and those Linear layers
        # stay on torch's GEMMs.
        self.linear_tiles = {torch.bfloat16: 0, torch.float32: int(tile_f32())}
        # The bf16 kernels this build has, by name, and the one this process runs.
        have = int(modes())
        self.bf16_linear_modes = [name for name, bit in BF16_LINEAR.items() if have & bit]
        self.bf16_linear: str | None = None
        choice = self._pick_bf16_linear()
        if choice is not None:
            self.set_bf16_linear(choice)

    def _pick_bf16_linear(self) -> str | None:
        """$SPECSERVE_BF16_LINEAR, else AMX tiles where the build has them and Linux lends
        them (as fast as the others on one row, where the weight stream bounds every
        kernel, and 3-5x FMA from 8 rows), else the only kernel built, else whichever of
        vdpbf16ps and FMA multiplies faster here: FMA where its measured multiply-add
        peak is 1.25x or more of vdpbf16ps's (2x on the Xeon with AMX, 0.5x on a Zen 4)."""
        asked = envs.bf16_linear()
        if asked != "auto":
            if asked not in self.bf16_linear_modes:
                have = ", ".join(self.bf16_linear_modes) or "none"
                raise ValueError(
                    f"SPECSERVE_BF16_LINEAR={asked}: these kernels ({self.path.name}) have "
                    f"no {asked} bf16 Linear kernel; they have: {have}"
                )
            return asked
        if "amx" in self.bf16_linear_modes:
            logger.info("bf16 Linear layers on AMX tiles (SPECSERVE_BF16_LINEAR pins one)")
            return "amx"
        if len(self.bf16_linear_modes) < 2:
            return self.bf16_linear_modes[0] if self.bf16_linear_modes else None
        fma = self._peak_gmacs(0, _PICK_ITERS, 1)
        dp = self._peak_gmacs(1, _PICK_ITERS, 1)
        choice = "fma" if fma >= 1.25 * dp else "vdpbf16ps"
        logger.info(
            "bf16 Linear layers on the %s kernel: multiply-add peaks fp32 FMA %.0f, "
            "vdpbf16ps %.0f G/s a core (SPECSERVE_BF16_LINEAR pins one)",
            choice,
            fma,
            dp,
        )
        return choice

    @property
    def decoder_team(self) -> bool:
        """Whether the one-call decoder runs its kernels on one team of threads (the
        default; the same bits as a region per kernel, fewer waits)."""
        return bool(self._decoder_team(-1))

    @property
    def decoder_team_calls(self) -> int:
        """One-call decoder calls the team has run in this process (tests check that a
        configuration takes it: one whose Linear layers have no team form, or one
        thread, runs a region per kernel)."""
        return int(self._decoder_team_calls())

    def set_decoder_team(self, on: bool) -> bool:
        """Turn the one-call decoder's team on or off (to compare them); returns the
        setting before. Process-wide: every model on this library follows it."""
        before = self.decoder_team
        self._decoder_team(1 if on else 0)
        return before

    def set_bf16_linear(self, name: str) -> str | None:
        """Run bf16 Linear layers on kernel ``name`` (one of ``bf16_linear_modes``) from
        now on; returns the one before. Weights packed for one serve the others (the same
        layout on AVX512). They give different bits: a process keeps one while it serves."""
        tile = int(self._set_bf16_linear(BF16_LINEAR.get(name, 0)))
        if not tile:
            raise ValueError(f"no {name!r} bf16 Linear kernel here: {self.bf16_linear_modes}")
        before = self.bf16_linear
        if before is not None and tile != self.linear_tiles[torch.bfloat16]:
            raise ValueError(f"the {name} kernel packs weights otherwise than {before}")
        self.bf16_linear, self.linear_tiles[torch.bfloat16] = name, tile
        return before

    @property
    def has_bf16_linear(self) -> bool:
        """Whether ``linear`` runs bf16 here (built for a CPU with AVX512-BF16 or FMA)."""
        return self.linear_tiles[torch.bfloat16] > 0

    @property
    def has_f32_linear(self) -> bool:
        """Whether ``linear`` runs float32 here (built for a CPU with FMA: AVX2 and up)."""
        return self.linear_tiles[torch.float32] > 0

    def has_linear(self, dtype: torch.dtype) -> bool:
        return self.linear_tiles.get(dtype, 0) > 0

    def pack_linear_weight(
        self, weight: torch.Tensor, storage: torch.dtype | None = None
    ) -> torch.Tensor:
        """A Linear weight [n, k] in ``linear``'s layout for activations of its dtype,
        zero-padded (cpu_kernels.c): bf16 as [ceil(n / tile), ceil(k / 2), tile, 2];
        float32 stored as float32 (the default) [ceil(n / tile), k, tile], or stored as
        ``storage=torch.bfloat16`` in the pair layout, which only a weight whose values
        are all bf16 numbers survives unchanged (``is_bf16_exact``)."""
        if weight.dtype not in _FLOATS or not weight.is_cpu or weight.dim() != 2:
            raise ValueError(
                f"weight must be a 2-D float32 or bfloat16 CPU tensor, got {weight.dtype} "
                f"{tuple(weight.shape)} on {weight.device}"
            )
        storage = weight.dtype if storage is None else storage
        if storage not in _FLOATS or (weight.dtype is torch.bfloat16 and storage != weight.dtype):
            raise ValueError(f"a {weight.dtype} weight cannot be stored as {storage}")
        self._require_linear(weight.dtype)
        n, k = weight.shape
        shape = self._packed_shape(weight.dtype, storage, n, k)
        tiles, tile = shape[0], shape[2]
        if storage is torch.float32:
            padded = weight.new_zeros(tiles * tile, k)
            padded[:n] = weight
            return padded.view(tiles, tile, k).transpose(1, 2).contiguous()
        padded = torch.zeros(tiles * tile, shape[1] * 2, dtype=torch.bfloat16)
        padded[:n, :k] = weight
        return padded.view(tiles, tile, shape[1], 2).transpose(1, 2).contiguous()

    def _packed_shape(
        self, dtype: torch.dtype, storage: torch.dtype, n: int, k: int
    ) -> tuple[int, ...]:
        tile = self.linear_tiles[dtype]
        if storage is torch.float32:
            return (-(-n // tile), k, tile)
        return (-(-n // tile), -(-k // 2), tile, 2)

    def linear(
        self,
        x: torch.Tensor,  # [m, k] bf16 or float32, rows may be strided
        packed: torch.Tensor,  # pack_linear_weight(weight [n, k]), weight of x's dtype
        bias: torch.Tensor | None,  # [n], x's dtype
        out_features: int,  # n
    ) -> torch.Tensor:  # [m, n] x's dtype: x @ weight.T + bias, independent of m
        """``F.linear`` with fp32 accumulation over k in order (fused multiply-adds in
        float32) and one rounding per output, so a row's result never depends on the
        other rows; float32 rows take float32 or bf16-stored weights alike."""
        dtype = _check_float("x", x, 2, rows_strided=True)
        self._require_linear(dtype)
        storage = packed.dtype
        if dtype is torch.bfloat16 or storage is not torch.bfloat16:
            _check_float("packed", packed, 4 if storage is torch.bfloat16 else 3, (dtype, "x"))
        else:
            _check_float("packed", packed, 4)
        m, k = x.shape
        n = out_features
        if packed.shape != self._packed_shape(dtype, storage, n, k):
            raise ValueError(
                f"packed {tuple(packed.shape)} is not a packed [{n}, {k}] weight: "
                f"expected {self._packed_shape(dtype, storage, n, k)}"
            )
        if bias is not None:
            _check_float("bias", bias, 1, (dtype, "x"))
            if bias.shape[0] != n:
                raise ValueError(f"bias [{bias.shape[0]}] != out_features {n}")
        out = x.new_empty(m, n)
        if not m:
            return out
        args = (
            None if bias is None else bias.data_ptr(), m, n, k, torch.get_num_threads(),
        )  # fmt: skip
        if dtype is torch.bfloat16:
            if self._linear_bf16(
                out.data_ptr(), x.data_ptr(), x.stride(0), packed.data_ptr(), *args
            ):
                raise MemoryError("the bf16 Linear kernel could not allocate its scratch")
        else:
            self._linear_f32(
                out.data_ptr(), x.data_ptr(), x.stride(0), packed.data_ptr(),
                int(storage is torch.bfloat16), *args,
            )  # fmt: skip
        return out

    def _require_linear(self, dtype: torch.dtype) -> None:
        if not self.has_linear(dtype):
            need = "AVX512-BF16 or FMA" if dtype is torch.bfloat16 else "FMA (AVX2 and up)"
            raise RuntimeError(
                f"the {dtype} linear kernel needs a build for a CPU with {need}; "
                "this library has none (use torch's GEMMs)"
            )

    def paged_attention(
        self,
        out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rows may be strided
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
        seq_lens: torch.Tensor,  # [num_seqs] int32
        query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
        seq_ids: torch.Tensor,  # [num_selected] int32: the sequences to compute
        max_query_len: int,  # over the selected sequences
        scale: float,
        tree_masks: torch.Tensor | None = None,  # [num_tokens] int64 (AttentionMetadata)
    ) -> None:
        dtype = _check_float("query", query, 3, rows_strided=True)
        _check_float("out", out, 3, (dtype, "query"), rows_strided=True)
        cache_dtype = _check_kv_cache(k_cache, v_cache, (dtype, "query"))
        num_tokens, num_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads, kv_head_dim = k_cache.shape
        if kv_head_dim != head_dim or num_heads % num_kv_heads:
            raise ValueError(
                f"query heads {tuple(query.shape[1:])} do not fit KV cache {tuple(k_cache.shape)}"
            )
        if out.shape != query.shape:
            raise ValueError(f"out {tuple(out.shape)} != query {tuple(query.shape)}")
        num_seqs = check_sequences(block_tables, seq_lens, query_start_loc, seq_ids)
        if not 0 <= max_query_len <= num_tokens:
            raise ValueError(f"max_query_len={max_query_len} must be in [0, {num_tokens}]")
        max_rows = max_query_len * (num_heads // num_kv_heads)
        if tree_masks is not None:
            _check_tree_masks(tree_masks, num_tokens)
        status = self._kv_entries[(dtype, cache_dtype)].paged_attention(
            out.data_ptr(),
            out.stride(0),
            query.data_ptr(),
            query.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            block_tables.shape[1],
            seq_lens.data_ptr(),
            query_start_loc.data_ptr(),
            num_seqs,
            num_tokens,
            seq_ids.data_ptr(),
            seq_ids.shape[0],
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            num_blocks,
            scale,
            max(max_rows, 1),
            torch.get_num_threads(),
            None if tree_masks is None else tree_masks.data_ptr(),
        )
        if status == 2:
            raise ValueError(f"a selected sequence has more than max_query_len={max_query_len}")
        if status == 3:
            raise ValueError(
                f"a block id outside 0..{num_blocks - 1}, a sequence id outside seq_lens, or "
                "lengths that do not fit the block table or the query"
            )
        if status:
            raise MemoryError("paged attention could not allocate its scratch buffers")

    def rms_norm(
        self,
        x: torch.Tensor,  # [num_rows, hidden]
        weight: torch.Tensor,  # [hidden]
        eps: float,
        residual: torch.Tensor | None = None,  # [num_rows, hidden], updated in place
    ) -> torch.Tensor:
        dtype = _check_float("x", x, 2)
        _check_float("weight", weight, 1, (dtype, "x"))
        if weight.shape[0] != x.shape[1]:
            raise ValueError(f"weight [{weight.shape[0]}] must be [{x.shape[1]}], x's width")
        if residual is not None:
            _check_float("residual", residual, 2, (dtype, "x"))
            if residual.shape != x.shape:
                raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
        out = torch.empty_like(x)
        self._entries[dtype].rms_norm(
            out.data_ptr(),
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            x.shape[0],
            x.shape[1],
            eps,
            torch.get_num_threads(),
        )
        return out

    def rope(
        self,
        x: torch.Tensor,  # [num_tokens, width]: rows start with the heads to rotate
        positions: torch.Tensor,  # [num_tokens] int64
        cos_sin: torch.Tensor,  # [max_positions, 2, head_dim // 2]
        num_rotated: int,  # heads rotated in place at the start of each row
    ) -> None:
        dtype = _check_float("x", x, 2, rows_strided=True)
        _check_float("cos_sin", cos_sin, 3, (dtype, "x"))
        if cos_sin.shape[1] != 2 or cos_sin.shape[2] < 1:
            raise ValueError(
                f"cos_sin {tuple(cos_sin.shape)} must be [max_positions, 2, head_dim // 2]"
            )
        head_dim = cos_sin.shape[2] * 2
        if not 0 <= num_rotated * head_dim <= x.shape[1]:
            raise ValueError(
                f"num_rotated={num_rotated} heads of {head_dim} must fit in x {tuple(x.shape)}"
            )
        _check_index("positions", positions, x.shape[0])
        status = self._entries[dtype].rope(
            x.data_ptr(),
            x.stride(0),
            x.shape[0],
            positions.data_ptr(),
            cos_sin.data_ptr(),
            cos_sin.shape[0],
            num_rotated,
            head_dim,
            torch.get_num_threads(),
        )
        if status:
            raise ValueError(f"a position is outside the rotary table's 0..{cos_sin.shape[0] - 1}")

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rows may be strided
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [num_tokens] int64, -1 = padding (not written)
    ) -> None:
        dtype = _check_float("key", key, 3, rows_strided=True)
        _check_float("value", value, 3, (dtype, "key"), rows_strided=True)
        cache_dtype = _check_kv_cache(k_cache, v_cache, (dtype, "key"))
        if key.shape[1:] != k_cache.shape[2:] or value.shape != key.shape:
            raise ValueError(
                f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit cache "
                f"{tuple(k_cache.shape)}"
            )
        _check_index("slots", slots, key.shape[0])
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        status = self._kv_entries[(dtype, cache_dtype)].write_kv(
            key.data_ptr(),
            key.stride(0),
            value.data_ptr(),
            value.stride(0),
            key.shape[0],
            key.shape[1] * key.shape[2],
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slots.data_ptr(),
            num_slots,
        )
        if status:
            raise ValueError(f"a slot in slots is past the cache's {num_slots} slots")

    def read_gbps(self, buffer: torch.Tensor, reps: int, num_threads: int) -> float:
        """The best read bandwidth (GB/s) over ``reps`` passes through ``buffer`` (a
        contiguous CPU tensor of a multiple of 64 bytes) on ``num_threads`` threads."""
        nbytes = buffer.numel() * buffer.element_size()
        if not buffer.is_cpu or not buffer.is_contiguous() or nbytes % 64 or nbytes == 0:
            raise ValueError("buffer must be a contiguous CPU tensor of a multiple of 64 bytes")
        sink = ctypes.c_uint64(0)
        return self._read_gbps(buffer.data_ptr(), nbytes, reps, num_threads, ctypes.byref(sink))

    def peak_gmacs(self, kind: int, iters: int, num_threads: int) -> float | None:
        """Multiply-adds per second (G) of one instruction kind (0 fp32 FMA, 1 bf16
        vdpbf16ps, 2 int8 vpdpbusd, or vpmaddubsw + vpmaddwd on AVX2 without VNNI, 3
        vpdpbusd on 256-bit registers, 4 AMX tdpbssd, 5 AMX tdpbf16ps) in a register-only loop on
        ``num_threads`` threads; None when this build lacks it."""
        value = self._peak_gmacs(kind, iters, num_threads)
        return None if value < 0 else value

    def mask_logits(self, logits: torch.Tensor, words: torch.Tensor) -> list[int]:
        """In place: -inf in each row of fp32 ``logits`` [rows, vocab] (rows may be
        strided) where the row's bitmask ``words`` [rows, >= ceil(vocab / 32)] int32 has no
        bit, or the logit is not finite. Returns the rows left with no token."""
        if logits.dtype is not torch.float32:
            raise ValueError(f"logits must be float32, got {logits.dtype}")
        _check_float("logits", logits, 2, rows_strided=True)
        rows, vocab = logits.shape
        if (
            words.dtype is not torch.int32
            or not words.is_cpu
            or not words.is_contiguous()
            or words.dim() != 2
            or words.shape[0] != rows
            or words.shape[1] * 32 < vocab
        ):
            raise ValueError(
                f"words must be a contiguous int32 CPU tensor [{rows}, >= {-(-vocab // 32)}], "
                f"got {words.dtype} {tuple(words.shape)} on {words.device}"
            )
        dead = torch.empty(rows, dtype=torch.uint8)
        status = self._mask_logits(
            logits.data_ptr(),
            rows,
            vocab,
            logits.stride(0) if rows > 1 else vocab,
            words.data_ptr(),
            words.shape[1],
            dead.data_ptr(),
            torch.get_num_threads(),
        )
        if status:
            raise ValueError("words do not cover the vocabulary")
        return dead.nonzero().flatten().tolist()

    def row_argmax(self, x: torch.Tensor) -> torch.Tensor:
        """The first maximal index of each row of fp32 ``x`` [rows, n] (rows may be
        strided; n >= 1), a NaN counting as maximal: ``x.max(dim=-1).indices``'s int64
        values, in a fraction of its time."""
        argmax = self._sampling_fn("specserve_row_argmax_f32")
        rows, n, stride = _fp32_rows("x", x, min_cols=1)
        out = torch.empty(rows, dtype=torch.int64)
        if rows:
            argmax(out.data_ptr(), x.data_ptr(), rows, n, stride, torch.get_num_threads())
        return out

    def nonfinite_rows(self, x: torch.Tensor) -> list[int]:
        """The rows of fp32 ``x`` [rows, n] (rows may be strided) that hold a NaN or
        +Inf, in order: [] when every value is finite or -Inf."""
        check = self._sampling_fn("specserve_rows_nonfinite_f32")
        rows, n, stride = _fp32_rows("x", x, min_cols=0)
        if not rows or not n:
            return []
        flags = torch.empty(rows, dtype=torch.int32)
        if not check(flags.data_ptr(), x.data_ptr(), rows, n, stride, torch.get_num_threads()):
            return []
        return [r for r, bad in enumerate(flags.tolist()) if bad]

    def sample_rows(self, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """One token per row of fp32 ``probs`` [rows, n] (rows may be strided; p >= 0,
        finite) by inverse CDF at ``u`` [rows] float64 in [0, 1): the first index whose
        running sum exceeds u times the row's sum (sums in double)."""
        draw = self._sampling_fn("specserve_sample_rows_f32")
        rows, n, stride = _fp32_rows("probs", probs, min_cols=1)
        if u.dtype is not torch.float64 or not u.is_cpu or u.shape != (rows,):
            raise ValueError(f"u must be a float64 CPU tensor [{rows}], got {u.dtype} "
                             f"{tuple(u.shape)} on {u.device}")  # fmt: skip
        u = u.contiguous()
        out = torch.empty(rows, dtype=torch.int64)
        if rows:
            draw(
                out.data_ptr(), probs.data_ptr(), rows, n, stride, u.data_ptr(),
                torch.get_num_threads(),
            )  # fmt: skip
        return out

    def _sampling_fn(self, name: str):
        fn = self._sampling[name]
        if fn is None:
            raise RuntimeError(f"{self.path.name} predates {name}: built from an older source")
        return fn

    def exponential_rows(self, out: torch.Tensor, keys: list[int]) -> torch.Tensor:
        """Fill fp32 ``out`` [rows, n] (rows may be strided) with Exp(1) noise, row r a
        function of ``keys[r]`` (a 64-bit key: Python ints taken modulo 2^64) and the
        column alone; returns ``out``."""
        noise = self._sampling_fn("specserve_exponential_rows")
        rows, n, stride = _fp32_rows("out", out, min_cols=0)
        if len(keys) != rows:
            raise ValueError(f"keys must have one key per row of out ({rows}), got {len(keys)}")
        if rows and n:
            key_array = (ctypes.c_uint64 * rows)(*(k & 0xFFFFFFFFFFFFFFFF for k in keys))
            noise(out.data_ptr(), rows, n, stride, key_array, torch.get_num_threads())
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # [n, 2 * inter] -> [n, inter]
        dtype = _check_float("x", x, 2)
        if x.shape[1] % 2:
            raise ValueError(f"x's width {x.shape[1]} must be even: gate and up, side by side")
        inter = x.shape[1] // 2
        out = x.new_empty(x.shape[0], inter)
        self._entries[dtype].silu_and_mul(
            out.data_ptr(), x.data_ptr(), x.shape[0], inter, torch.get_num_threads()
        )
        return out


def _fp32_rows(name: str, t: torch.Tensor, min_cols: int) -> tuple[int, int, int]:
    """Rows, columns and the row stride (for C) of a 2-D fp32 CPU tensor whose rows are
    dense (sampling's kernels: rows may be strided); at least ``min_cols`` columns."""
    if t.dtype is not torch.float32:
        raise ValueError(f"{name} must be float32, got {t.dtype}")
    _check_float(name, t, 2, rows_strided=True)
    rows, n = t.shape
    if n < min_cols:
        raise ValueError(f"{name} must have at least one column, got shape {tuple(t.shape)}")
    return rows, n, t.stride(0) if rows > 1 else n


def _check_float(
    name: str,
    t: torch.Tensor,
    dims: int,
    like: tuple[torch.dtype, str] | None = None,
    rows_strided: bool = False,
) -> torch.dtype:
    """float32 or bfloat16 on the CPU (``like``: the call's dtype and the argument that
    set it, which ``t`` must share), ``dims``-D and dense; with ``rows_strided`` only
    each row (dims 1..) must be dense and rows must not overlap: the stride between rows
    is passed to C. Returns the dtype. (Called several times per layer: kept to a few
    attribute reads.)"""
    dtype = t.dtype
    if dtype not in _FLOATS or not t.is_cpu or t.layout is not torch.strided:
        raise ValueError(
            f"{name} must be a float32 or bfloat16 CPU tensor, got {dtype} ({t.layout}) "
            f"on {t.device}"
        )
    if like is not None and dtype is not like[0]:
        raise ValueError(
            f"{name} is {dtype} but {like[1]} is {like[0]}: the float tensors of one call "
            "must share one dtype"
        )
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    if not rows_strided:
        ok = t.is_contiguous()
    else:
        stride, shape = t.stride(), t.shape
        row = shape[1] if dims == 2 else shape[1] * shape[2]
        ok = (stride[-1] == 1 or shape[-1] == 1) and (stride[0] >= row or shape[0] <= 1)
        if dims == 3:
            ok = ok and (stride[1] == shape[2] or shape[1] == 1)
    if not ok:
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()})")
    return dtype


def _check_kv_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, like: tuple[torch.dtype, str]
) -> torch.dtype:
    """The caches' dtype: the rows' (``like``), or bfloat16 under float32 rows."""
    if like[0] is torch.float32 and k_cache.dtype is torch.bfloat16:
        _check_float("k_cache", k_cache, 4)
        like = (torch.bfloat16, "k_cache")
    else:
        _check_float("k_cache", k_cache, 4, like)
    _check_float("v_cache", v_cache, 4, like)
    shape = k_cache.shape
    if v_cache.shape != shape:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(shape)}")
    if shape[1] < 1 or shape[2] < 1 or shape[3] < 1:
        raise ValueError(
            f"k_cache {tuple(shape)}: block_size, num_kv_heads and head_dim must be >= 1"
        )
    return like[0]


def _check_index(name: str, t: torch.Tensor, length: int) -> None:
    if t.dtype is not torch.int64 or not t.is_cpu or t.layout is not torch.strided:
        raise ValueError(f"{name} must be an int64 CPU tensor, got {t.dtype} on {t.device}")
    if t.shape != (length,) or not t.is_contiguous():
        raise ValueError(f"{name} {tuple(t.shape)} must be [{length}] and contiguous")


def check_sequences(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_ids: torch.Tensor,  # [num_selected] int32
) -> int:
    """Paged attention's sequence arguments (types, ranks, and agreement on the number of
    sequences, which it returns); C checks the values they hold."""
    _check_i32("block_tables", block_tables, 2)
    for name, t in (
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
        ("seq_ids", seq_ids),
    ):
        _check_i32(name, t, 1)
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)}, seq_lens [{num_seqs}] and "
            f"query_start_loc [{query_start_loc.shape[0]}] disagree on the sequences"
        )
    return num_seqs


def _check_i32(name: str, t: torch.Tensor, dims: int) -> None:
    """int32 on the CPU, ``dims``-D, each row contiguous (C is given the row stride)."""
    if t.dtype is not torch.int32 or not t.is_cpu or t.layout is not torch.strided:
        raise ValueError(f"{name} must be an int32 CPU tensor, got {t.dtype} on {t.device}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous along its rows (got strides {t.stride()})")


def serves(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the kernels are written for ``device`` and ``dtype`` (CPU; float32 or
    bfloat16)."""
    return torch.device(device).type == "cpu" and dtype in _FLOATS


def kernels_for(device: torch.device | str, dtype: torch.dtype) -> CpuKernels | None:
    """The kernels when they serve ``device`` / ``dtype`` and are available, else None."""
    return cpu_kernels() if serves(device, dtype) else None


@contextlib.contextmanager
def cpu_kernels_enabled(enabled: bool) -> Iterator[None]:
    """Switch the kernels on or off (``SPECSERVE_CPU_KERNELS``) for a block, then put the
    environment and ``cpu_kernels()``'s cached answer back as they were."""
    with envs.overridden("SPECSERVE_CPU_KERNELS", "1" if enabled else "0"):
        cpu_kernels.cache_clear()
        try:
            yield
        finally:
            cpu_kernels.cache_clear()


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The process-wide kernels, or None (logged once) when they cannot be used. A
    level asked for by name (``SPECSERVE_KERNEL_LEVEL``) that cannot be had is an error,
    not a silent fall back to torch ops."""
    if not envs.cpu_kernels():
        return None
    try:
        kernels = CpuKernels(build_library())
        kernels.set_decoder_team(envs.decoder_team())
        return kernels
    except (KernelBuildError, OSError, AttributeError) as exc:
        if envs.kernel_level() is not None:
            raise
        logger.warning("CPU kernels unavailable, using torch ops (slower): %s", exc)
        return None


def _check_tree_masks(tree_masks: torch.Tensor, num_tokens: int) -> None:
    """One int64 mask per packed token, dense on the CPU (the kernel reads them raw)."""
    if (
        tree_masks.dtype is not torch.int64
        or tree_masks.shape != (num_tokens,)
        or not tree_masks.is_contiguous()
        or not tree_masks.is_cpu
    ):
        raise ValueError(
            f"tree_masks must be a dense [num_tokens={num_tokens}] int64 CPU tensor, got "
            f"{tuple(tree_masks.shape)} {tree_masks.dtype} on {tree_masks.device}"
        )
