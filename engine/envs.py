"""Every environment variable specserve reads, in one place.

Other modules call these functions instead of touching ``os.environ``, so the full list
of knobs is visible here and tests can monkeypatch the environment.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def cache_dir() -> Path:
    """Root of specserve's own cache (default model, converted GGUF weights).

    ``$SPECSERVE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/specserve``,
    else ``~/.cache/specserve``.
    """
    explicit = os.environ.get("SPECSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "specserve"
    return Path.home() / ".cache" / "specserve"


def hub_timeout_s() -> float:
    """Seconds to wait for the Hugging Face hub before declaring it unreachable."""
    return float(os.environ.get("SPECSERVE_HUB_TIMEOUT_S", "10"))


def cpu_weight_packing() -> bool:
    """``SPECSERVE_CPU_WEIGHT_PACKING=0`` keeps plain ``nn.Linear`` weights on CPU
    instead of oneDNN-prepacked ones (slower; for debugging and comparisons)."""
    return os.environ.get("SPECSERVE_CPU_WEIGHT_PACKING", "1") != "0"


def kernel_cache_dir() -> Path:
    """Where compiled CPU kernels are kept: ``$SPECSERVE_KERNEL_CACHE_DIR``, else
    ``<cache_dir>/kernels``. A build there is loaded only when nobody but this user or
    root could have written it; when that fails, or the directory is read-only with no
    build for this CPU (a baked image on another CPU kind), the process builds a private
    copy instead (engine/kernels/build.py)."""
    explicit = os.environ.get("SPECSERVE_KERNEL_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    return cache_dir() / "kernels"


def kernel_level() -> str | None:
    """``SPECSERVE_KERNEL_LEVEL=<level>`` (one of ``build.PREBUILT_LEVELS``, e.g.
    ``x86-64-v3``) runs the CPU kernels built for that instruction-set level instead of
    for this CPU (``-march=native``): what a CPU of that level runs, on this machine's
    cores and memory (reproducing an AVX2 machine's code path on a newer one, or pinning
    one build across a fleet). Unset, empty or ``native``: this CPU's own build."""
    value = os.environ.get("SPECSERVE_KERNEL_LEVEL", "").strip()
    return None if value in ("", "native") else value


def fused_decoder() -> bool:
    """``SPECSERVE_FUSED_DECODER=0`` runs a CPU model's decoder layers one Python
    call at a time instead of in one call into the kernels (engine/kernels/decoder.py;
    the same result, slower; for profiling each kernel on its own)."""
    return os.environ.get("SPECSERVE_FUSED_DECODER", "1") != "0"


def kv_hugepages() -> bool:
    """``SPECSERVE_KV_HUGEPAGES=0`` leaves a CPU KV cache on the pages Linux gives any
    allocation, instead of asking for 2 MB pages (``MADV_HUGEPAGE``, engine/attention:
    fewer TLB misses when attention reads blocks from anywhere in the cache)."""
    return os.environ.get("SPECSERVE_KV_HUGEPAGES", "1") != "0"


def weight_hugepages() -> bool:
    """``SPECSERVE_WEIGHT_HUGEPAGES=0`` leaves a CPU model's weights where loading put
    them, on 4 KB pages, instead of moving the large ones into one allocation advised
    onto 2 MB pages (engine/models/weights.py, ``weights_on_huge_pages``: a decode step
    streams every weight, a TLB miss every 4 KB otherwise)."""
    return os.environ.get("SPECSERVE_WEIGHT_HUGEPAGES", "1") != "0"


def decoder_team() -> bool:
    """``SPECSERVE_DECODER_TEAM=0`` runs the one-call decoder with an OpenMP
    region per kernel instead of all its kernels on one team of threads meeting at a
    spinning barrier (engine/kernels/decoder_kernels.c; the same bits, a few percent
    slower at batch 1; for comparing them, or a host where spinning threads hurt)."""
    return os.environ.get("SPECSERVE_DECODER_TEAM", "1") != "0"


def bf16_linear() -> str:
    """``SPECSERVE_BF16_LINEAR=amx|vdpbf16ps|fma`` pins the kernel of a bf16 model's
    Linear layers on CPU (engine/kernels/cpu_kernels.c): AMX tiles (tdpbf16ps; AMX-BF16,
    where Linux lends the tiles), vdpbf16ps (AVX512-BF16) or bf16 widened to fp32 and
    multiplied by FMA (any CPU with FMA). Unset or ``auto``: AMX where it is here, else
    the one whose measured multiply-add peak is higher (FMA where it is 1.25x or more of
    vdpbf16ps's). They give different bits; a fleet that must agree pins one."""
    value = os.environ.get("SPECSERVE_BF16_LINEAR", "").strip()
    return value or "auto"


def cpu_kernels() -> bool:
    """``SPECSERVE_CPU_KERNELS=0`` keeps torch ops on CPU instead of specserve's compiled
    kernels (paged attention, RMSNorm, rotary, SiLU, and the bf16 Linear layers, which
    then run on oneDNN; slower; for debugging and comparisons)."""
    return os.environ.get("SPECSERVE_CPU_KERNELS", "1") != "0"


def forced_tokens() -> bool:
    """``SPECSERVE_FORCED_TOKENS=0`` decodes a constraint's forced tokens one step each
    instead of feeding them as drafts in one (the same output; for measuring)."""
    return os.environ.get("SPECSERVE_FORCED_TOKENS", "1") != "0"


def lazy_greedy_masks() -> bool:
    """``SPECSERVE_LAZY_GREEDY_MASKS=0`` computes every greedy constrained row's mask
    beside the forward instead of only the rows whose argmax the constraint refuses
    (the same output; for measuring)."""
    return os.environ.get("SPECSERVE_LAZY_GREEDY_MASKS", "1") != "0"


def grammar_compile_timeout_s() -> float:
    """How long a structured_output constraint may take to compile before the request is
    refused (INVALID_ARGUMENT naming the limit): ``SPECSERVE_GRAMMAR_COMPILE_TIMEOUT_S``,
    default 10 seconds."""
    return float(os.environ.get("SPECSERVE_GRAMMAR_COMPILE_TIMEOUT_S", "10"))


@contextlib.contextmanager
def overridden(name: str, value: str) -> Iterator[None]:
    """Set environment variable ``name`` to ``value`` for a block, then put it back as it
    was (unset if it was unset)."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved
