"""Build, load and call the fp32 CPU kernels in cpu_kernels.c.

The C file is compiled once per machine with the system compiler (``cc``, or ``$CC``)
and cached in ``envs.kernel_cache_dir()`` (``<cache>/kernels``) keyed by the source,
the compiler and the CPU's instruction-set flags (it is built with ``-march=native``,
so a cache shared between different CPUs gets one library per CPU kind). Compiling
takes about a second. A read-only cache (a baked container image) falls back to the
system temp directory for a CPU it has no build for.

``cpu_kernels()`` returns None, after logging one line, when the kernels are off
(``SPECSERVE_CPU_KERNELS=0``), there is no compiler, or the build fails; callers then
use their torch implementations. Every wrapper checks what it is given (device, dtype,
contiguity) and raises ValueError with the offending argument, so a misuse can never
become an out-of-bounds read in C.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from engine import envs

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_kernels.c")
# Compiled and linked in two steps: linking with -ffast-math (gcc < 13) adds
# crtfastmath.o, whose constructor turns on flush-to-zero for the whole process when
# the library loads, silently changing every other float computation (hypothesis
# caught it). The kernels still get fast-math code (vectorised expf); nothing else does.
_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
_LINK_FLAGS = ["-shared", "-fopenmp"]

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32
_F32 = ctypes.c_float
_SIGNATURES = {
    "specserve_paged_attention": (
        ctypes.c_int,
        [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I32, _P, _P, _I32, _I64, _P, _I32]
        + [_I32, _I32, _I32, _I32, _I32, _F32, _I32, _I32],
    ),
    "specserve_rms_norm": (None, [_P, _P, _P, _P, _I64, _I64, _F32, _I32]),
    "specserve_rope": (ctypes.c_int, [_P, _I64, _I64, _P, _P, _I64, _I32, _I32, _I32]),
    "specserve_write_kv": (ctypes.c_int, [_P, _I64, _P, _I64, _I64, _I64, _P, _P, _P, _I64]),
    "specserve_silu_and_mul": (None, [_P, _P, _I64, _I64, _I32]),
}


class KernelBuildError(RuntimeError):
    pass


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def build_library(out_dir: Path | None = None) -> Path:
    """Compile cpu_kernels.c (or reuse the cached build); returns the .so path."""
    cc = _compiler()
    if cc is None:
        raise KernelBuildError("no C compiler found (set $CC or install gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        source
        + version.encode()
        + _cpu_flags().encode()
        + " ".join(_COMPILE_FLAGS + _LINK_FLAGS).encode()
    ).hexdigest()[:16]
    name = f"cpu_kernels-{key}.so"
    out_dir = out_dir or envs.kernel_cache_dir()
    if (out_dir / name).exists():
        return out_dir / name
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        writable = os.access(out_dir, os.W_OK)
    except OSError:
        writable = False
    if not writable:
        out_dir = Path(tempfile.gettempdir()) / f"specserve-kernels-{os.getuid()}"
        out_dir.mkdir(parents=True, exist_ok=True)
        if (out_dir / name).exists():
            return out_dir / name
    target = out_dir / name
    logger.info("building specserve's CPU kernels into %s (once per CPU kind)", out_dir)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        obj, tmp_target = Path(tmp) / "cpu_kernels.o", Path(tmp) / target.name
        for cmd in (
            [cc, *_COMPILE_FLAGS, "-c", str(_SOURCE), "-o", str(obj)],
            [cc, *_LINK_FLAGS, str(obj), "-o", str(tmp_target), "-lm"],
        ):
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                lines = result.stderr.strip().splitlines() or ["(no output)"]
                first = next((line for line in lines if "error" in line), lines[0])
                raise KernelBuildError(f"{cc} failed to build {_SOURCE.name}: {first}")
        os.replace(tmp_target, target)  # atomic: concurrent builders agree on one file
    return target


class CpuKernels:
    """Typed wrappers over the loaded library."""

    def __init__(self, path: Path) -> None:
        # torch (imported above) has loaded libgomp.so.1; the library needs the same
        # soname, so the dynamic loader hands it torch's copy: one OpenMP thread pool.
        self.lib = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        self.path = path

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
    ) -> None:
        num_heads, head_dim = query.shape[1:]
        num_blocks, block_size, num_kv_heads, kv_head_dim = k_cache.shape
        _check_f32("query", query, rows_strided=True)
        _check_f32("out", out, rows_strided=True)
        _check_f32("k_cache", k_cache)
        _check_f32("v_cache", v_cache)
        for name, t in (
            ("block_tables", block_tables),
            ("seq_lens", seq_lens),
            ("query_start_loc", query_start_loc),
            ("seq_ids", seq_ids),
        ):
            _check_i32(name, t)
        if kv_head_dim != head_dim or num_heads % num_kv_heads or v_cache.shape != k_cache.shape:
            raise ValueError(
                f"query heads {tuple(query.shape[1:])} do not fit KV cache {tuple(k_cache.shape)}"
            )
        if block_tables.dim() != 2 or block_tables.stride(1) != 1:
            raise ValueError("block_tables must be [num_seqs, width], contiguous along rows")
        num_seqs = seq_lens.numel()
        if block_tables.shape[0] != num_seqs or query_start_loc.numel() != num_seqs + 1:
            raise ValueError(
                f"block_tables {tuple(block_tables.shape)}, seq_lens [{num_seqs}] and "
                f"query_start_loc [{query_start_loc.numel()}] disagree on the sequences"
            )
        if out.shape != query.shape:
            raise ValueError(f"out {tuple(out.shape)} != query {tuple(query.shape)}")
        max_rows = max_query_len * (num_heads // num_kv_heads)
        status = self.lib.specserve_paged_attention(
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
            query.shape[0],
            seq_ids.data_ptr(),
            seq_ids.numel(),
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            num_blocks,
            scale,
            max(max_rows, 1),
            torch.get_num_threads(),
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
        _check_f32("x", x)
        _check_f32("weight", weight)
        if residual is not None:
            _check_f32("residual", residual)
            if residual.shape != x.shape:
                raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
        out = torch.empty_like(x)
        self.lib.specserve_rms_norm(
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
        head_dim = cos_sin.shape[2] * 2
        _check_f32("x", x, rows_strided=True)
        _check_f32("cos_sin", cos_sin)
        if x.dim() != 2 or num_rotated * head_dim > x.shape[1]:
            raise ValueError(f"x {tuple(x.shape)} has no room for {num_rotated} heads")
        _check_index("positions", positions, x.shape[0])
        status = self.lib.specserve_rope(
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
        _check_f32("key", key, rows_strided=True)
        _check_f32("value", value, rows_strided=True)
        _check_f32("k_cache", k_cache)
        _check_f32("v_cache", v_cache)
        if key.shape[1:] != k_cache.shape[2:] or value.shape != key.shape:
            raise ValueError(
                f"key/value {tuple(key.shape)} do not fit cache {tuple(k_cache.shape)}"
            )
        _check_index("slots", slots, key.shape[0])
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        status = self.lib.specserve_write_kv(
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

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # [n, 2 * inter] -> [n, inter]
        _check_f32("x", x)
        inter = x.shape[1] // 2
        out = x.new_empty(x.shape[0], inter)
        self.lib.specserve_silu_and_mul(
            out.data_ptr(), x.data_ptr(), x.shape[0], inter, torch.get_num_threads()
        )
        return out


def _check_f32(name: str, t: torch.Tensor, rows_strided: bool = False) -> None:
    """float32 on the CPU and dense; with ``rows_strided`` only each row (dims 1..) must
    be dense, the stride between rows is passed to C. (Called several times per layer:
    kept to a few attribute reads.)"""
    if t.dtype is not torch.float32 or not t.is_cpu:
        raise ValueError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
    if not rows_strided:
        ok = t.is_contiguous()
    else:
        stride, shape = t.stride(), t.shape
        ok = stride[-1] == 1 or shape[-1] == 1
        if t.dim() == 3:
            ok = ok and (stride[1] == shape[2] or shape[1] == 1)
        elif t.dim() != 2:
            ok = False
    if not ok:
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()})")


def _check_index(name: str, t: torch.Tensor, length: int) -> None:
    if t.dtype is not torch.int64 or not t.is_cpu or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous int64 CPU tensor")
    if t.shape != (length,):
        raise ValueError(f"{name} {tuple(t.shape)} must be [{length}]")


def _check_i32(name: str, t: torch.Tensor) -> None:
    if t.dtype is not torch.int32 or not t.is_cpu:
        raise ValueError(f"{name} must be an int32 CPU tensor, got {t.dtype} on {t.device}")
    if t.dim() == 1 and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def serves(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the kernels are written for ``device`` and ``dtype`` (CPU, float32)."""
    return torch.device(device).type == "cpu" and dtype == torch.float32


def kernels_for(device: torch.device | str, dtype: torch.dtype) -> CpuKernels | None:
    """The kernels when they serve ``device`` / ``dtype`` and are available, else None."""
    return cpu_kernels() if serves(device, dtype) else None


@contextlib.contextmanager
def cpu_kernels_enabled(enabled: bool) -> Iterator[None]:
    """Switch the kernels on or off (``SPECSERVE_CPU_KERNELS``) for a block, then put the
    environment and ``cpu_kernels()``'s cached answer back as they were."""
    saved = os.environ.get("SPECSERVE_CPU_KERNELS")
    os.environ["SPECSERVE_CPU_KERNELS"] = "1" if enabled else "0"
    cpu_kernels.cache_clear()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("SPECSERVE_CPU_KERNELS", None)
        else:
            os.environ["SPECSERVE_CPU_KERNELS"] = saved
        cpu_kernels.cache_clear()


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The process-wide kernels, or None (logged once) when they cannot be used."""
    if not envs.cpu_kernels():
        return None
    try:
        return CpuKernels(build_library())
    except (KernelBuildError, OSError, AttributeError) as exc:
        logger.warning("CPU kernels unavailable, using torch ops (slower): %s", exc)
        return None
