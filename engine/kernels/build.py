"""Compile cpu_kernels.c, and find a build that is safe to load.

The library is compiled once per machine with the system compiler (``cc``, or ``$CC``)
and cached in ``envs.kernel_cache_dir()`` (``<cache>/kernels``) under a name keyed by
the source, the compiler and the CPU's instruction-set flags (it is built with
``-march=native``, so a cache shared between different CPUs gets one library per CPU
kind). Compiling takes 10-20 s (one gcc -O3 on a 2-vCPU Xeon: 20 s for AVX-512 code, 11 s
for AVX2).

Loading a shared library runs its constructors, so a cached build is loaded only when
nobody but this user or root could have written it (``untrusted_reason``, the rule of
ssh's StrictModes). A build that fails the rule in a cache directory that passes it and
is writable is replaced there by a new one (atomically; only this user or root can
write that directory, so nobody else can swap the new one). A cache that fails
the rule, or that is read-only and has no usable build for this CPU (a baked container
image on another CPU kind), gets a private build for this process instead: compiled in
a new 0700 directory and loaded through its open file descriptor (``_build_private``).
Nothing is ever loaded from a path someone else can redirect.

A container image has no compiler at run time. Its build step calls ``prebuild``, which
compiles the library once per instruction-set level of the architecture (x86-64-v2, -v3
and -v4 on x86_64) into the baked cache; ``build_library`` falls back to the best of
those this CPU can run when it cannot build for ``-march=native`` itself.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

from engine import envs

logger = logging.getLogger(__name__)

# One translation unit, in this order (each part uses what the ones before it define);
# the compiler sees their concatenation as SOURCE.name, #line directives keeping its
# messages on the right file and line.
SOURCES = tuple(Path(__file__).with_name(name) for name in (
    "cpu_kernels.c", "quant_kernels.c", "decoder_kernels.c", "bounds_kernels.c",
))  # fmt: skip
SOURCE = SOURCES[0]
# Compiled and linked in two steps: linking with -ffast-math (gcc < 13) adds
# crtfastmath.o, whose constructor turns on flush-to-zero for the whole process when
# the library loads, silently changing every other float computation (hypothesis
# caught it). The kernels still get fast-math code (vectorised expf); nothing else does.
_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
_LINK_FLAGS = ["-shared", "-fopenmp"]
_PROC_FD = Path("/proc/self/fd")

# The x86-64 psABI micro-architecture levels, each with the /proc/cpuinfo flags a CPU
# needs to run code built with -march=<level> (each level includes the one below).
_X86_64_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_X86_64_V3 = _X86_64_V2 | {"abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"}
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# Not psABI levels: a level plus the extensions specserve's kernels use. AVX512-VNNI
# (Cascade Lake, Ice Lake and later, Zen 4 and later) runs the quantized Linear kernel
# on zmm; AVX512-BF16 with it (Zen 4 and later, Cooper Lake, Sapphire Rapids and later)
# the bf16 Linear kernel too; AVX-VNNI (Alder Lake and later) the quantized kernel's
# 256-bit dot products.
_X86_64_V4_VNNI = _X86_64_V4 | {"avx512_vnni"}
_X86_64_V4_VNNI_BF16 = _X86_64_V4_VNNI | {"avx512_bf16"}
_X86_64_V3_AVXVNNI = _X86_64_V3 | {"avx_vnni"}
# AMX-INT8 and AMX-BF16 (Sapphire Rapids and later): the quantized Linear's Q8_0 GEMMs
# and the bf16 Linear on tiles.
_X86_64_V4_AMX = _X86_64_V4_VNNI_BF16 | {"amx_tile", "amx_int8", "amx_bf16"}
# Per architecture (``platform.machine()``): prebuilt levels, best first.
PREBUILT_LEVELS: dict[str, list[tuple[str, frozenset[str]]]] = {
    "x86_64": [
        ("x86-64-v4-amx", _X86_64_V4_AMX),
        ("x86-64-v4-vnni-bf16", _X86_64_V4_VNNI_BF16),
        ("x86-64-v4-vnni", _X86_64_V4_VNNI),
        ("x86-64-v4", _X86_64_V4),
        ("x86-64-v3-avxvnni", _X86_64_V3_AVXVNNI),
        ("x86-64-v3", _X86_64_V3),
        ("x86-64-v2", _X86_64_V2),
    ],
    "aarch64": [("armv8-a", frozenset())],
}
# A test build, never a level a CPU is served with: the AMX paths compiled for a CPU
# with AVX512-BF16 and no AMX, each tile instruction run by C code that does what the
# instruction does (SPECSERVE_AMX_EMULATE in cpu_kernels.c, microseconds an
# instruction), so the kernel tests run those paths where no tiles exist
# (tests/engine/kernel_levels.py). The flags: the CPU's, to run it.
EMULATED_AMX_LEVEL = "x86-64-v4-amx-emulated"
_EMULATED_LEVELS = {"x86_64": {EMULATED_AMX_LEVEL: _X86_64_V4_VNNI_BF16}}


class KernelBuildError(RuntimeError):
    pass


def read_source(read: Callable[[Path], bytes] = Path.read_bytes) -> bytes:
    """The kernels' translation unit: every part of SOURCES, each after a #line
    directive naming it. ``read`` gives a part's bytes (default: the file's; a benchmark
    comparing builds reads another revision's)."""
    return b"".join(f'#line 1 "{path.name}"\n'.encode() + read(path) for path in SOURCES)


def build_library(out_dir: Path | None = None) -> Path:
    """A compiled cpu_kernels.c that is safe to load: the cached ``-march=native`` build
    in ``out_dir`` (default ``envs.kernel_cache_dir()``) when it passes
    ``untrusted_reason``, else a new one there (replacing one that failed) when that
    directory passes it and is writable, else the best trusted ``prebuild`` variant
    there that this CPU can run, else ``_build_private``. A cached build that fails the
    rule is logged once, in one warning line saying which of those happens instead."""
    cc = _compiler()
    source = read_source()
    cache = _canonical(out_dir or envs.kernel_cache_dir())
    level = envs.kernel_level()
    if level is not None:
        return _build_level(cc, source, cache, level)
    problem: tuple[int, str] | None = None
    refused = ""  # "not loading PATH: why; " when the cached build failed the rule
    if cc is not None:
        name = library_name(cc, source)
        if os.path.lexists(cache / name):
            reason = untrusted_reason(cache / name)
            if reason is None:
                return cache / name
            refused = f"not loading {cache / name}: {reason}; "
        problem = _cache_problem(cache)
        if problem is None:
            if refused:
                logger.warning("%sreplacing it with a new build in the cache", refused)
            return _build_cached(cc, source, cache, name)
    prebuilt = _prebuilt(cache, source)
    if prebuilt is not None:
        logger.log(
            logging.WARNING if refused else logging.INFO,
            "%susing the prebuilt CPU kernels %s",
            refused,
            prebuilt,
        )
        return prebuilt
    if cc is None:
        raise KernelBuildError(
            f"no C compiler found (set $CC or install gcc), and {cache} holds no prebuilt "
            "kernels this CPU can run"
        )
    assert problem is not None
    level, why = problem
    level = max(level, logging.WARNING) if refused else level
    logger.log(level, "%skernel cache %s %s; building a private copy", refused, cache, why)
    return _build_private(cc, source, name)


def level_flags(level: str) -> frozenset[str]:
    """The /proc/cpuinfo flags code built for ``level`` (a ``PREBUILT_LEVELS`` name of
    this architecture) may use; KernelBuildError naming the levels for any other."""
    levels = dict(PREBUILT_LEVELS.get(platform.machine(), []))
    if level not in levels:
        known = ", ".join(["native", *levels])
        raise KernelBuildError(
            f"SPECSERVE_KERNEL_LEVEL={level!r} is not a kernel level of "
            f"{platform.machine()}; expected one of: {known}"
        )
    return levels[level]


def level_unrunnable(level: str) -> str | None:
    """Why this CPU cannot run ``level``'s code (native, or a ``PREBUILT_LEVELS`` name),
    in a few words for a benchmark's one-line error; None where it can."""
    if level == "native":
        return None
    names = [name for name, _ in PREBUILT_LEVELS.get(platform.machine(), [])]
    if level not in names:
        return f"no kernel level {level!r}: native or any of {', '.join(names)}"
    if not level_flags(level) <= cpu_flags():
        return f"this CPU cannot run {level} code"
    return None


def _build_level(cc: str | None, source: bytes, cache: Path, level: str) -> Path:
    """The build for ``level`` ($SPECSERVE_KERNEL_LEVEL): its trusted prebuilt variant
    in ``cache``, else compiled into ``cache`` when that passes the rule and is
    writable, else privately. Refused (one line naming the levels, or the CPU flags the
    level needs and this CPU lacks) for a level this CPU cannot run."""
    missing = level_flags(level) - cpu_flags()
    if missing:
        raise KernelBuildError(
            f"SPECSERVE_KERNEL_LEVEL={level} needs CPU flags this CPU lacks: "
            + ", ".join(sorted(missing))
        )
    name = prebuilt_name(source, level)
    if os.path.lexists(cache / name):
        reason = untrusted_reason(cache / name)
        if reason is None:
            return cache / name
        logger.warning("not loading %s: %s", cache / name, reason)
    if cc is None:
        raise KernelBuildError(
            f"no C compiler found (set $CC or install gcc), and {cache} holds no trusted "
            f"prebuilt kernels for SPECSERVE_KERNEL_LEVEL={level}"
        )
    if _cache_problem(cache) is None:
        return _build_cached(cc, source, cache, name, march=level)
    return _build_private(cc, source, name, march=level)


def prebuild(
    out_dir: Path, machine: str | None = None, only: Collection[str] | None = None
) -> list[Path]:
    """Build the library for every instruction-set level of ``machine`` (default this
    one's) into ``out_dir``, for runtimes without a compiler (a container image's build
    step); ``only``: those of the levels alone (a benchmark comparing a few). Returns the
    files, best level first."""
    cc = _compiler()
    if cc is None:
        raise KernelBuildError("no C compiler found (set $CC or install gcc)")
    machine = machine or platform.machine()
    if machine not in PREBUILT_LEVELS:
        raise KernelBuildError(f"no prebuilt kernel levels for {machine}")
    source = read_source()
    out = _canonical(out_dir)
    _make_dirs(out)

    def build(level: str) -> Path:
        name = prebuilt_name(source, level)
        with _build_dir(out) as build_dir:
            _compile(cc, source, build_dir, name, march=level)
            os.close(_open_build(build_dir[1], name))
            os.replace(name, out / name, src_dir_fd=build_dir[1])
        return out / name

    # One compiler a CPU: each level is one single-threaded compile of 10-20 s.
    levels = [level for level, _ in PREBUILT_LEVELS[machine] if only is None or level in only]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    jobs = max(1, min(len(levels), cpus or 1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(build, levels))


def prebuild_levels(out_dir: Path, levels: Collection[str]) -> dict[str, Path]:
    """``prebuild`` of ``levels`` alone (``PREBUILT_LEVELS`` names): each level's file."""
    wanted = [level for level, _ in PREBUILT_LEVELS.get(platform.machine(), []) if level in levels]
    return dict(zip(wanted, prebuild(out_dir, only=wanted), strict=True))


def prebuilt_name(source: bytes, level: str) -> str:
    """A prebuilt variant's file name: keyed by source and flags, named by its level."""
    flags = " ".join(_compile_flags(level) + _LINK_FLAGS)
    key = hashlib.sha256(source + flags.encode()).hexdigest()[:16]
    return f"cpu_kernels-{key}-{level}.so"


def _prebuilt(cache: Path, source: bytes) -> Path | None:
    """The best trusted prebuilt variant in ``cache`` whose level this CPU supports."""
    have = cpu_flags()
    for level, needs in PREBUILT_LEVELS.get(platform.machine(), []):
        path = cache / prebuilt_name(source, level)
        if not needs <= have or not os.path.lexists(path):
            continue
        reason = untrusted_reason(path)
        if reason is None:
            return path
        logger.warning("not loading %s: %s", path, reason)
    return None


def _build_cached(cc: str, source: bytes, cache: Path, name: str, march: str = "native") -> Path:
    logger.info("building specserve's CPU kernels (%s) into %s (once per CPU kind)", march, cache)
    with _build_dir(cache) as build_dir:
        _compile(cc, source, build_dir, name, march=march)
        dir_fd = build_dir[1]
        os.close(_open_build(dir_fd, name))
        # atomic: concurrent builders agree on one file, and an untrusted one is replaced
        os.replace(name, cache / name, src_dir_fd=dir_fd)
    return cache / name


def _build_private(cc: str, source: bytes, name: str, march: str = "native") -> Path:
    """A build for this process alone, in a new 0700 directory under the system temp
    directory that is removed again. The path returned, ``/proc/self/fd/N``, names the
    built file itself (held open for the life of the process), so nobody who can write
    the temp directory (a Kubernetes emptyDir /tmp is 0777, not sticky) can swap it
    before it is loaded."""
    if not _PROC_FD.is_dir():
        raise KernelBuildError("no trusted, writable kernel cache, and no /proc to load from")
    logger.info("building specserve's CPU kernels for this process (10-20 s)")
    with _build_dir(Path(tempfile.gettempdir())) as build_dir:
        _compile(cc, source, build_dir, name, march=march)
        fd = _open_build(build_dir[1], name)
    return _PROC_FD / str(fd)


def library_name(cc: str, source: bytes) -> str:
    """The cached build's file name: keyed by source, compiler, flags and CPU kind."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        source
        + version.encode()
        + _cpu_flags().encode()
        + " ".join(_COMPILE_FLAGS + _LINK_FLAGS).encode()
    ).hexdigest()[:16]
    return f"cpu_kernels-{key}.so"


def untrusted_reason(path: Path) -> str | None:
    """Why ``path`` (a library, or a directory for one) could hold code written by
    someone other than this user or root; None when it cannot. ``path``, and the
    directory holding it when it is a file, must be no symlink, owned by us or root and
    not writable by group or others. Every directory above must be owned by us or root
    and not writable by group or others unless sticky (like /tmp: others may add
    entries there but not move or replace ours)."""
    try:
        leaf = [path] if stat.S_ISDIR(os.lstat(path).st_mode) else [path, path.parent]
        for p in leaf:
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                return f"{p} is a symlink"
            reason = _permission_problem(p, st, sticky_ok=False)
            if reason is not None:
                return reason
        above = Path(os.path.realpath(leaf[-1].parent))
        for p in (above, *above.parents):
            reason = _permission_problem(p, os.stat(p), sticky_ok=True)
            if reason is not None:
                return reason
    except OSError as exc:
        return f"cannot check {exc.filename}: {exc.strerror}"
    return None


def _permission_problem(path: Path, st: os.stat_result, sticky_ok: bool) -> str | None:
    if not _trusted_owner(st.st_uid):
        return f"{path} is owned by uid {st.st_uid}"
    if st.st_mode & 0o022 and not (sticky_ok and st.st_mode & stat.S_ISVTX):
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _trusted_owner(uid: int) -> bool:
    return uid == 0 or uid == os.geteuid()


def _cache_problem(cache: Path) -> tuple[int, str] | None:
    """None when new builds may go into ``cache``; else a log level and why not."""
    try:
        _make_dirs(cache)
    except OSError as exc:
        return logging.INFO, f"cannot be created ({exc.strerror})"
    reason = untrusted_reason(cache)
    if reason is not None:
        return logging.WARNING, f"is not trusted ({reason})"
    if not os.access(cache, os.W_OK):
        return logging.INFO, "is read-only and has no usable build for this CPU"
    return None


def _make_dirs(path: Path) -> None:
    """``mkdir -p``, each new directory 0755 whatever the umask: under the common umask
    002 the default mode would be group-writable, and fail the trust rule at once."""
    if path.is_dir():
        return
    _make_dirs(path.parent)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o755)


def _canonical(path: Path) -> Path:
    """``path`` made absolute with every symlink above it resolved, so that the trust
    rule checks the directories the loader will go through. A symlink at ``path``
    itself is kept, for the rule to refuse."""
    path = Path(os.path.abspath(path))
    return Path(os.path.realpath(path.parent)) / path.name


@contextlib.contextmanager
def _build_dir(parent: Path) -> Iterator[tuple[Path, int]]:
    """A new 0700 directory under ``parent`` and a descriptor open on it; removed on
    exit. Builds work through the descriptor, so a writable ``parent`` cannot swap the
    directory under the compiler or the loader."""
    path = Path(tempfile.mkdtemp(prefix=".specserve-build-", dir=parent))
    dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        st = os.fstat(dir_fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise KernelBuildError(f"{path} was replaced while building the CPU kernels")
        yield path, dir_fd
    finally:
        for entry in os.listdir(dir_fd):
            with contextlib.suppress(OSError):
                os.unlink(entry, dir_fd=dir_fd)
        os.close(dir_fd)
        with contextlib.suppress(OSError):
            os.rmdir(path)


# Levels that are a psABI level plus extensions: the -march value and the extra flags.
_LEVEL_FLAGS = {
    "x86-64-v4-amx": [
        "-march=x86-64-v4",
        "-mavx512vnni",
        "-mavx512bf16",
        "-mamx-tile",
        "-mamx-int8",
        "-mamx-bf16",
    ],  # fmt: skip
    "x86-64-v4-vnni-bf16": ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"],
    "x86-64-v4-vnni": ["-march=x86-64-v4", "-mavx512vnni"],
    "x86-64-v3-avxvnni": ["-march=x86-64-v3", "-mavxvnni"],
}
# the -v4-vnni-bf16 level's code with the AMX paths in, their tiles emulated
_LEVEL_FLAGS[EMULATED_AMX_LEVEL] = [*_LEVEL_FLAGS["x86-64-v4-vnni-bf16"], "-DSPECSERVE_AMX_EMULATE"]


def _compile_flags(march: str) -> list[str]:
    level = _LEVEL_FLAGS.get(march, [f"-march={march}"])
    return [g for f in _COMPILE_FLAGS for g in (level if f == "-march=native" else [f])]


def _compile(
    cc: str, source: bytes, build_dir: tuple[Path, int], name: str, march: str = "native"
) -> None:
    """Compile ``source`` (the bytes hashed into ``name``) into ``name`` inside
    ``build_dir``. The compiler runs in that directory through its descriptor
    (/proc/self/fd/N) with relative names and TMPDIR=., so every file it reads or writes
    besides headers and libraries is in the directory we opened."""
    path, dir_fd = build_dir
    fd = os.open(SOURCE.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
    with os.fdopen(fd, "wb") as f:
        f.write(source)
    # Without /proc (only reached for a cache whose directories passed the rule) the
    # path is as safe: nobody else can move it.
    cwd = _PROC_FD / str(dir_fd) if _PROC_FD.is_dir() else path
    env = {**os.environ, "TMPDIR": "."}
    for cmd in (
        [cc, *_compile_flags(march), "-c", SOURCE.name, "-o", "cpu_kernels.o"],
        [cc, *_LINK_FLAGS, "cpu_kernels.o", "-o", name, "-lm"],
    ):
        result = subprocess.run(
            cmd, capture_output=True, text=True, cwd=cwd, env=env, pass_fds=(dir_fd,)
        )
        if result.returncode != 0:
            lines = result.stderr.strip().splitlines() or ["(no output)"]
            first = next((line for line in lines if "error" in line), lines[0])
            raise KernelBuildError(f"{cc} failed to build the CPU kernels: {first}")


def _open_build(dir_fd: int, name: str) -> int:
    """A descriptor on the built library, made 0755 whatever the umask (a group- or
    world-writable build would fail the trust rule, and rightly)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    os.fchmod(fd, 0o755)
    return fd


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """This CPU's feature flags (or those of the given /proc/cpuinfo text)."""
    return frozenset(_cpu_flags(cpuinfo).partition(":")[2].split())


def _cpu_flags(cpuinfo: str | None = None) -> str:
    """The /proc/cpuinfo line naming the CPU's features: "flags" on x86, "Features" on
    Arm; empty when there is none."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ""
    for line in cpuinfo.splitlines():
        if line.partition(":")[0].strip() in ("flags", "Features"):
            return line
    return ""


def emulated_amx_runnable(cpuinfo: str | None = None) -> bool:
    """Whether this CPU runs the emulated AMX level's code (``EMULATED_AMX_LEVEL``)."""
    needs = _EMULATED_LEVELS.get(platform.machine(), {}).get(EMULATED_AMX_LEVEL)
    return needs is not None and needs <= cpu_flags(cpuinfo)


def build_source(source: bytes, level: str = "native") -> Path:
    """``source`` (a translation unit in ``read_source``'s form, e.g. the kernels of
    another revision) built for this CPU, or for a ``PREBUILT_LEVELS`` level it runs,
    for this process alone: benchmarks that compare two builds side by side load it
    with ``CpuKernels``."""
    cc = _compiler()
    if cc is None:
        raise KernelBuildError("no C compiler found (set $CC or install gcc)")
    return _build_private(cc, source, library_name(cc, source), march=level)


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
