"""Which compiled kernel library specserve agrees to load (engine/kernels/build.py).

A library planted where the loader looks has a constructor that writes a marker file:
if specserve ever loads it, the marker appears. The rule under test (ssh's StrictModes):
the library and its directory are no symlinks, owned by us or root and not writable by
group or others; every directory above is owned by us or root and not writable by group
or others unless sticky.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import build as build_mod
from engine.kernels.cpu import CpuKernels, build_library, cpu_kernels
from engine.kernels.quant import QuantOps

_PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *marker = getenv("SPECSERVE_TEST_MARKER");
    FILE *f = marker ? fopen(marker, "w") : NULL;
    if (f) {
        fputs("planted code ran\n", f);
        fclose(f);
    }
}
"""
_OTHER_UID = 65534  # nobody

# Builds of the kernel source reuse the session's compiles (tests/conftest.py): what
# is under test here is where builds go and which file is loaded.
pytestmark = pytest.mark.usefixtures("compile_once")


@pytest.fixture(scope="module")
def planted_library(tmp_path_factory) -> Path:
    """A shared library whose load-time constructor writes $SPECSERVE_TEST_MARKER."""
    d = tmp_path_factory.mktemp("planted-src")
    (d / "planted.c").write_text(_PLANTED_C)
    cc = build_mod._compiler()
    assert cc is not None, "the kernel tests need a C compiler"
    subprocess.run(
        [cc, "-shared", "-fPIC", str(d / "planted.c"), "-o", str(d / "planted.so")], check=True
    )
    return d / "planted.so"


@pytest.fixture
def marker(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "marker"
    monkeypatch.setenv("SPECSERVE_TEST_MARKER", str(path))
    return path


def _library_name() -> str:
    return build_mod.library_name(build_mod._compiler(), build_mod.read_source())


def _plant(planted_library: Path, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / _library_name()
    shutil.copyfile(planted_library, target)
    target.chmod(0o755)
    return target


def _give_away(path: Path, monkeypatch) -> None:
    """Make ``path`` another user's: for real as root, else by making only root trusted
    (then everything of ours looks foreign too, which the rule must also refuse)."""
    if os.geteuid() == 0:
        os.chown(path, _OTHER_UID, _OTHER_UID, follow_symlinks=False)
    else:
        monkeypatch.setattr(build_mod, "_trusted_owner", lambda uid: uid == 0)


def _assert_works(kernels: CpuKernels) -> None:
    x = torch.randn(3, 8)
    gate, up = x.split(4, dim=1)
    torch.testing.assert_close(kernels.silu_and_mul(x), F.silu(gate) * up)


def test_the_planted_library_runs_when_loaded(planted_library, marker, tmp_path):
    """The control: a planted library that passes the rule (ours, 0755, in a directory
    of ours) is loaded, and its constructor writes the marker. So the tests below, where
    the marker stays absent, would catch a load; today's code loaded every one."""
    cache = tmp_path / "cache"
    planted = _plant(planted_library, cache)
    assert build_library(cache) == planted
    with pytest.raises(AttributeError):  # no specserve_* symbols in it
        CpuKernels(planted)
    assert marker.exists()


def _writable_cache(cache, planted, monkeypatch):
    cache.chmod(0o777)
    return "writable by group or others (mode 0777)"


def _group_writable_cache(cache, planted, monkeypatch):
    cache.chmod(0o775)
    return "writable by group or others (mode 0775)"


def _writable_library(cache, planted, monkeypatch):
    planted.chmod(0o666)
    return "writable by group or others (mode 0666)"


def _symlinked_library(cache, planted, monkeypatch):
    elsewhere = cache.parent / "elsewhere.so"
    planted.rename(elsewhere)
    planted.symlink_to(elsewhere)
    return "is a symlink"


def _foreign_cache(cache, planted, monkeypatch):
    _give_away(cache, monkeypatch)
    return "owned by uid"


def _foreign_library(cache, planted, monkeypatch):
    _give_away(planted, monkeypatch)
    return "owned by uid"


def _writable_ancestor(cache, planted, monkeypatch):
    cache.parent.chmod(0o777)  # no sticky bit: others could move our cache away
    return f"{cache.parent} is writable by group or others (mode 0777)"


def _foreign_ancestor(cache, planted, monkeypatch):
    _give_away(cache.parent, monkeypatch)
    return "owned by uid"


@pytest.mark.parametrize(
    "make_hostile",
    [
        _writable_cache,
        _group_writable_cache,
        _writable_library,
        _symlinked_library,
        _foreign_cache,
        _foreign_library,
        _writable_ancestor,
        _foreign_ancestor,
    ],
)
def test_a_planted_library_is_never_loaded(
    planted_library, marker, tmp_path, monkeypatch, caplog, make_hostile
):
    cache = tmp_path / "shared" / "cache"
    planted = _plant(planted_library, cache)
    why = make_hostile(cache, planted, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="engine.kernels.build"):
        built = build_library(cache)
    _assert_works(CpuKernels(built))
    assert not marker.exists()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert str(planted) in warnings[0] and why in warnings[0]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


_AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="gives a file away for real as root")


@pytest.mark.parametrize(
    "make_hostile",
    [_writable_library, _symlinked_library, pytest.param(_foreign_library, marks=_AS_ROOT)],
)
def test_a_bad_build_in_a_trusted_writable_cache_is_replaced_there_and_says_so(
    planted_library, marker, tmp_path, monkeypatch, caplog, make_hostile
):
    """Only we or root can write the directory, so the bad file is ours to replace: a
    new build takes its name atomically (a symlink is replaced, not followed), the log
    line says so (it once said "building a private copy" while doing this), and the
    next start loads the new build without a word."""
    cache = tmp_path / "shared" / "cache"
    planted = _plant(planted_library, cache)
    why = make_hostile(cache, planted, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="engine.kernels.build"):
        built = build_library(cache)
    assert built == planted and not built.is_symlink()
    assert build_mod.untrusted_reason(built) is None
    _assert_works(CpuKernels(built))
    assert not marker.exists()
    [warning] = _warnings(caplog)
    assert warning.startswith(f"not loading {planted}: ") and why in warning
    assert warning.endswith("; replacing it with a new build in the cache")
    if (cache.parent / "elsewhere.so").exists():  # the symlink's target is left alone
        assert (cache.parent / "elsewhere.so").read_bytes() == planted_library.read_bytes()
    caplog.clear()
    mtime = built.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="engine.kernels.build"):
        assert build_library(cache) == built and built.stat().st_mtime_ns == mtime
    assert not caplog.records


def _read_only_with_a_writable_library(cache, planted, monkeypatch):
    _read_only_cache(cache, monkeypatch)
    planted.chmod(0o666)
    return "writable by group or others (mode 0666)"


@pytest.mark.parametrize(
    "make_hostile",
    [_writable_cache, _foreign_cache, _writable_ancestor, _read_only_with_a_writable_library],
)
def test_a_bad_build_in_an_unusable_cache_gets_a_private_copy_and_says_so(
    planted_library, marker, tmp_path, monkeypatch, caplog, make_hostile
):
    """Where we may not (or cannot) write, the bad file stays as it is and this process
    builds its own, loaded through its descriptor; the one line says exactly that."""
    cache = tmp_path / "shared" / "cache"
    planted = _plant(planted_library, cache)
    why = make_hostile(cache, planted, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="engine.kernels.build"):
        built = build_library(cache)
    assert built.parent == Path("/proc/self/fd")
    _assert_works(CpuKernels(built))
    assert not marker.exists()
    assert planted.read_bytes() == planted_library.read_bytes()  # not replaced
    [warning] = _warnings(caplog)
    assert warning.startswith(f"not loading {planted}: ") and why in warning
    assert warning.endswith("; building a private copy")


def test_the_old_shared_temp_fallback_is_not_consulted(
    planted_library, marker, tmp_path, monkeypatch
):
    """Today's code fell back to <temp>/specserve-kernels-<uid>, a name anyone can
    compute, and loaded what it found there."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    temp.chmod(0o1777)
    monkeypatch.setattr(build_mod.tempfile, "tempdir", str(temp))
    _plant(planted_library, temp / f"specserve-kernels-{os.getuid()}")
    read_only = _read_only_cache(tmp_path / "baked", monkeypatch)
    _assert_works(CpuKernels(build_library(read_only)))
    assert not marker.exists()


def test_cpu_kernels_end_to_end_refuse_a_planted_cache(
    planted_library, marker, tmp_path, monkeypatch
):
    cache = tmp_path / "kernels"
    _plant(planted_library, cache)
    cache.chmod(0o777)
    monkeypatch.setenv("SPECSERVE_KERNEL_CACHE_DIR", str(cache))
    cpu_kernels.cache_clear()
    try:
        kernels = cpu_kernels()
        assert kernels is not None
        _assert_works(kernels)
    finally:
        cpu_kernels.cache_clear()
    assert not marker.exists()


def _read_only_cache(path: Path, monkeypatch) -> Path:
    """``path`` as the serving user sees a baked image's cache: not writable. (Root
    ignores permission bits, so for root os.access is told the truth it would see.)"""
    path.mkdir(parents=True, exist_ok=True)
    real_access = os.access
    monkeypatch.setattr(
        build_mod.os,
        "access",
        lambda p, mode: not (Path(p) == path and mode & os.W_OK) and real_access(p, mode),
    )
    return path


def test_a_root_owned_read_only_baked_cache_is_used(tmp_path, monkeypatch, caplog):
    """The container image: the cache was built as root at image build time and the
    server runs as uid 10001, for whom it is read-only. Root-owned counts as trusted."""
    baked = tmp_path / "baked"
    built = build_library(baked)
    mtime = built.stat().st_mtime_ns
    real_euid = os.geteuid()
    monkeypatch.setattr(build_mod.os, "geteuid", lambda: 10001)
    if real_euid != 0:  # we cannot make root-owned files: our uid stands in for root's
        monkeypatch.setattr(build_mod, "_trusted_owner", lambda uid: uid in (real_euid, 10001))
    _read_only_cache(baked, monkeypatch)
    baked.chmod(0o555)
    try:
        with caplog.at_level(logging.INFO, logger="engine.kernels.build"):
            again = build_library(baked)
    finally:
        baked.chmod(0o755)
    assert again == built and built.stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert not caplog.records


@pytest.mark.parametrize("temp_mode", [0o1777, 0o777])  # 0777: a Kubernetes emptyDir /tmp
def test_private_build_when_the_cache_is_unusable(tmp_path, monkeypatch, temp_mode):
    """A private build is loaded through its descriptor even when the temp directory
    is writable by anyone, and the temp directory is left as it was."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    temp.chmod(temp_mode)
    monkeypatch.setattr(build_mod.tempfile, "tempdir", str(temp))
    built = build_library(_read_only_cache(tmp_path / "baked", monkeypatch))
    assert built.parent == Path("/proc/self/fd")
    assert os.stat(built).st_mode & 0o022 == 0
    _assert_works(CpuKernels(built))
    assert not any(temp.iterdir()) and not any((tmp_path / "baked").iterdir())


@pytest.mark.parametrize("umask", [0o000, 0o002])
def test_builds_are_never_group_or_world_writable(tmp_path, umask):
    """Directories created for the cache and the library itself, whatever the umask:
    else the next start would (rightly) refuse its own cache."""
    cache = tmp_path / "new" / "kernels"
    old = os.umask(umask)
    try:
        built = build_library(cache)
    finally:
        os.umask(old)
    assert built == cache / _library_name()
    for path in (built, cache, cache.parent):
        assert path.stat().st_mode & 0o022 == 0, oct(path.stat().st_mode)
    mtime = built.stat().st_mtime_ns
    assert build_library(cache) == built and built.stat().st_mtime_ns == mtime


def test_a_sticky_world_writable_ancestor_is_fine(tmp_path):
    """Like /tmp: others may add entries but not move ours, so a cache of ours inside
    it is trusted and reused."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    built = build_library(sticky / "kernels")
    assert built == sticky / "kernels" / _library_name()
    assert build_mod.untrusted_reason(built) is None
    mtime = built.stat().st_mtime_ns
    assert build_library(sticky / "kernels") == built and built.stat().st_mtime_ns == mtime


def test_untrusted_reason_walks_every_ancestor(tmp_path):
    deep = tmp_path / "a" / "b" / "c"
    deep.mkdir(parents=True)
    library = deep / "lib.so"
    library.write_bytes(b"")
    assert build_mod.untrusted_reason(library) is None
    (tmp_path / "a").chmod(0o757)
    assert build_mod.untrusted_reason(library) == (
        f"{tmp_path / 'a'} is writable by group or others (mode 0757)"
    )
    (tmp_path / "a").chmod(0o1757)  # sticky above the holding directory: fine
    assert build_mod.untrusted_reason(library) is None
    deep.chmod(0o1777)  # but not for the directory holding the library
    assert "mode 1777" in build_mod.untrusted_reason(library)
    deep.chmod(0o755)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "a")  # a symlink above is resolved, then checked
    assert build_mod.untrusted_reason(link / "b" / "c" / "lib.so") is None
    assert "cannot check" in build_mod.untrusted_reason(deep / "missing.so")


# --- prebuilt variants: a runtime with no compiler (the container image) -------------


def _cpu_with(monkeypatch, flags: frozenset[str]) -> None:
    line = "flags\t\t: " + " ".join(sorted(flags))
    monkeypatch.setattr(build_mod, "_cpu_flags", lambda cpuinfo=None: line)


@pytest.fixture(scope="module")
def prebuilt(prebuilt_kernel_dir, tmp_path_factory) -> tuple[Path, list[Path]]:
    """The session's ``prebuild`` output (tests/conftest.py: built once, not again here),
    copied, modes and all, to a cache of this module's own that the tests may write to."""
    built_dir, built = prebuilt_kernel_dir
    out = tmp_path_factory.mktemp("prebuilt") / "kernels"
    shutil.copytree(built_dir, out)
    return out, [out / path.name for path in built]


def test_prebuild_makes_one_library_per_level(prebuilt_kernel_dir):
    out, built = prebuilt_kernel_dir  # prebuild's own output, levels built side by side
    levels = [level for level, _ in build_mod.PREBUILT_LEVELS[build_mod.platform.machine()]]
    assert len(built) == len(levels)
    for path, level in zip(built, levels):
        assert path.parent == out and path.name.endswith(f"-{level}.so")
        assert build_mod.untrusted_reason(path) is None


def test_prebuild_only_builds_the_levels_asked_for(tmp_path, monkeypatch):
    """``only``: a benchmark comparing a few levels compiles those alone, returned in the
    levels' order whatever the order asked (the compiler replaced by one that writes an
    empty file: which levels it is asked for is the point)."""
    asked = []

    def compile_one(cc, source, build_dir, name, march="native"):
        asked.append(march)
        os.close(os.open(name, os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=build_dir[1]))

    monkeypatch.setattr(build_mod, "_compile", compile_one)
    levels = [level for level, _ in build_mod.PREBUILT_LEVELS[build_mod.platform.machine()]]
    wanted = [levels[-1], levels[0]]
    built = build_mod.prebuild(tmp_path, only=wanted)
    assert sorted(asked) == sorted(wanted)
    assert [p.name for p in built] == [
        build_mod.prebuilt_name(build_mod.read_source(), level) for level in (levels[0], levels[-1])
    ]
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".so") == sorted(
        p.name for p in built
    )


def test_without_a_compiler_the_best_level_this_cpu_runs_is_loaded(prebuilt, monkeypatch):
    out, built = prebuilt
    monkeypatch.setattr(build_mod, "_compiler", lambda: None)
    have = build_mod.cpu_flags()
    levels = build_mod.PREBUILT_LEVELS[build_mod.platform.machine()]
    expected = next(path for path, (_, needs) in zip(built, levels) if needs <= have)
    chosen = build_library(out)
    assert chosen == expected
    _assert_works(CpuKernels(chosen))  # and it computes what torch does


def test_a_cpu_below_the_top_level_gets_a_lower_one(prebuilt, monkeypatch):
    if build_mod.platform.machine() != "x86_64":
        pytest.skip("the levels are x86-64's")
    out, built = prebuilt
    monkeypatch.setattr(build_mod, "_compiler", lambda: None)
    _cpu_with(monkeypatch, build_mod._X86_64_V3)
    assert build_library(out).name.endswith("-x86-64-v3.so")
    _cpu_with(monkeypatch, build_mod._X86_64_V3 - {"avx2"})
    assert build_library(out).name.endswith("-x86-64-v2.so")


def test_the_bf16_level_has_both_bf16_linear_kernels_and_v4_the_fma_one(prebuilt, monkeypatch):
    """A container on an AVX512-BF16 CPU gets both bf16 Linear kernels (vdpbf16ps and
    widen + FMA), and with AMX the AMX one too; on an AVX-512 CPU without it, -v4, whose
    library has the FMA one."""
    if build_mod.platform.machine() != "x86_64":
        pytest.skip("the levels are x86-64's")
    out, _ = prebuilt
    have = build_mod.cpu_flags()  # what this CPU can load, before pretending below
    monkeypatch.setattr(build_mod, "_compiler", lambda: None)
    _cpu_with(monkeypatch, build_mod._X86_64_V4)
    v4 = build_library(out)
    assert v4.name.endswith("-x86-64-v4.so")
    _cpu_with(monkeypatch, build_mod._X86_64_V4_VNNI_BF16)
    v4_bf16 = build_library(out)
    assert v4_bf16.name.endswith("-x86-64-v4-vnni-bf16.so")
    _cpu_with(monkeypatch, build_mod._X86_64_V4_AMX)  # and with AMX, the AMX level
    v4_amx = build_library(out)
    assert v4_amx.name.endswith("-x86-64-v4-amx.so")
    if have >= build_mod._X86_64_V4_AMX:  # its Q8_0 Linear has the tile path, its bf16 too
        amx = CpuKernels(v4_amx)
        assert QuantOps(amx.lib).amx_min_rows == -1
        assert QuantOps(CpuKernels(v4_bf16).lib).amx_min_rows == 0
        assert amx.amx_tiles in (1, 2)  # built with AMX; 1: Linux did not lend the tiles
        assert ("amx" in amx.bf16_linear_modes) == (amx.amx_tiles == 2)
    if have >= build_mod._X86_64_V4:
        assert CpuKernels(v4).bf16_linear_modes == ["fma"]
    if have >= build_mod._X86_64_V4_VNNI_BF16:
        kernels = CpuKernels(v4_bf16)
        assert kernels.bf16_linear_modes == ["vdpbf16ps", "fma"]
        assert kernels.amx_tiles == 0
        weight = torch.randn(40, 16).to(torch.bfloat16)
        x = torch.randn(3, 16).to(torch.bfloat16)
        for mode in kernels.bf16_linear_modes:
            kernels.set_bf16_linear(mode)
            out_ = kernels.linear(x, kernels.pack_linear_weight(weight), None, 40)
            torch.testing.assert_close(
                out_.float(), (x.float() @ weight.float().T), rtol=1e-2, atol=1e-2
            )


def test_no_compiler_and_no_level_this_cpu_runs_is_one_clear_error(prebuilt, monkeypatch):
    if build_mod.platform.machine() != "x86_64":
        pytest.skip("every aarch64 CPU runs armv8-a")
    out, _ = prebuilt
    monkeypatch.setattr(build_mod, "_compiler", lambda: None)
    _cpu_with(monkeypatch, frozenset())
    with pytest.raises(build_mod.KernelBuildError, match="no C compiler found.*no prebuilt"):
        build_library(out)


def test_a_foreign_prebuilt_library_is_never_loaded(
    prebuilt, planted_library, marker, tmp_path, monkeypatch, caplog
):
    _, built = prebuilt
    cache = tmp_path / "kernels"
    cache.mkdir()
    planted = cache / built[-1].name  # the lowest level: every CPU of the kind runs it
    shutil.copyfile(planted_library, planted)
    planted.chmod(0o755)
    _give_away(planted, monkeypatch)
    monkeypatch.setattr(build_mod, "_compiler", lambda: None)
    with (
        caplog.at_level(logging.WARNING, logger="engine.kernels.build"),
        pytest.raises(build_mod.KernelBuildError),
    ):
        build_library(cache)
    assert "not loading" in caplog.text
    assert not marker.exists()


def test_with_a_compiler_a_writable_cache_still_gets_a_native_build(prebuilt, monkeypatch):
    out, built = prebuilt
    chosen = build_library(out)
    assert chosen not in built and chosen.name == _library_name()
    chosen.unlink()


# --- SPECSERVE_KERNEL_LEVEL: a named level's code on this CPU ---------------------------


def _lowest_level() -> tuple[str, frozenset[str]]:
    levels = build_mod.PREBUILT_LEVELS.get(build_mod.platform.machine())
    if not levels:
        pytest.skip(f"no kernel levels for {build_mod.platform.machine()}")
    return levels[-1]


def test_a_named_level_is_built_loaded_and_reused(prebuilt, tmp_path, monkeypatch):
    """The lowest level (every CPU of the kind runs it; on x86-64 the portable
    x86-64-v2 code) is what gets loaded, not the native build: its quantized Linear is
    the portable one, it still computes what torch does, and a second start takes the
    trusted file from the cache (the prebuilt one when the cache has it)."""
    level, _ = _lowest_level()
    monkeypatch.setenv("SPECSERVE_KERNEL_LEVEL", level)
    cache = tmp_path / "kernels"
    first = build_library(cache)
    assert first.parent == cache and first.name.endswith(f"-{level}.so")
    assert first.name == build_mod.prebuilt_name(build_mod.read_source(), level)
    kernels = CpuKernels(first)
    _assert_works(kernels)
    if build_mod.platform.machine() == "x86_64":
        assert QuantOps(kernels.lib).path == "portable"
    mtime = first.stat().st_mtime_ns
    assert build_library(cache) == first and first.stat().st_mtime_ns == mtime
    out, built = prebuilt  # a baked cache without a compiler: its prebuilt file
    monkeypatch.setattr(build_mod, "_compiler", lambda: None)
    assert build_library(out) == next(p for p in built if p.name.endswith(f"-{level}.so"))


def test_an_unknown_level_is_one_line_naming_the_levels_and_no_fallback(monkeypatch, tmp_path):
    """A level the operator named and cannot have fails, in one line: no silent fall
    back to the native build or to torch ops."""
    level, _ = _lowest_level()
    monkeypatch.setenv("SPECSERVE_KERNEL_LEVEL", "x86-64-v9")
    with pytest.raises(build_mod.KernelBuildError, match=f"expected one of: native, .*{level}"):
        build_library(tmp_path / "kernels")
    cpu_kernels.cache_clear()
    try:
        with pytest.raises(build_mod.KernelBuildError, match="x86-64-v9"):
            cpu_kernels()
    finally:
        cpu_kernels.cache_clear()


def test_a_level_this_cpu_cannot_run_names_the_missing_flags(monkeypatch, tmp_path):
    if build_mod.platform.machine() != "x86_64":
        pytest.skip("the levels are x86-64's")
    monkeypatch.setenv("SPECSERVE_KERNEL_LEVEL", "x86-64-v3")
    _cpu_with(monkeypatch, build_mod._X86_64_V3 - {"avx2", "fma"})
    with pytest.raises(build_mod.KernelBuildError, match="lacks: avx2, fma$"):
        build_library(tmp_path / "kernels")


def test_auto_dtype_follows_the_named_level(monkeypatch):
    """--dtype auto picks bf16 only where the kernels in use have native bf16: a CPU
    with AVX512-BF16 running the x86-64-v3 code is served like an AVX2 machine."""
    from engine.loader import cpu_has_native_bf16

    if build_mod.platform.machine() != "x86_64":
        pytest.skip("the levels are x86-64's")
    _cpu_with(monkeypatch, build_mod._X86_64_V4_VNNI_BF16)
    monkeypatch.delenv("SPECSERVE_KERNEL_LEVEL", raising=False)
    assert cpu_has_native_bf16()
    monkeypatch.setenv("SPECSERVE_KERNEL_LEVEL", "x86-64-v3")
    assert not cpu_has_native_bf16()
    monkeypatch.setenv("SPECSERVE_KERNEL_LEVEL", "x86-64-v4-vnni-bf16")
    assert cpu_has_native_bf16()
