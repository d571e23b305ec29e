"""The instruction-set levels kernel tests run at: the -march=native build, then every
prebuilt level (engine/kernels/build.py) this CPU can execute, best first, then, for
the suites whose kernels reach AMX code, on a CPU with AVX512-BF16 and no AMX, the AMX
level with its tile instructions emulated (``build.EMULATED_AMX_LEVEL``), so the AMX
paths' logic is tested where no tiles exist. The libraries are compiled once per test
session (``prebuilt_kernel_levels`` in tests/conftest.py), shared by every module that
runs at each level."""

from __future__ import annotations

import platform

from engine.kernels import build as build_mod


def runnable_levels(emulated_amx: bool = False) -> list[str]:
    """``emulated_amx``: the emulated AMX level too where ``emulate_amx()`` (for a suite
    whose kernels take AMX paths; elsewhere its code is the -v4-vnni-bf16 level's)."""
    have = build_mod.cpu_flags()
    levels = build_mod.PREBUILT_LEVELS.get(platform.machine(), [])
    runnable = ["native"] + [level for level, needs in levels if needs <= have]
    if emulated_amx and emulate_amx():
        runnable.append(build_mod.EMULATED_AMX_LEVEL)
    return runnable


def emulate_amx() -> bool:
    """Whether the AMX paths are tested on emulated tiles here: a CPU that runs the
    emulated level and has no AMX of its own (where it has, they run on its tiles)."""
    return build_mod.emulated_amx_runnable() and "amx_tile" not in build_mod.cpu_flags()


def kernels_at_level(request):
    """The kernels of a fixture's level param (``kernels_of``)."""
    return kernels_of(request, request.param)


def kernels_of(request, level: str):
    """The kernels of ``level``: the native build (one that failed to build fails the
    test), or the session's prebuilt library of that level."""
    import pytest

    from engine.kernels.cpu import CpuKernels, cpu_kernels

    if level == "native":
        found = cpu_kernels()
        if found is None:
            pytest.fail("CPU kernels failed to build; see the warning logged by cpu_kernels()")
        return found
    return CpuKernels(request.getfixturevalue("prebuilt_kernel_levels")[level])


def amx_kernels(request):
    """Kernels whose AMX paths run: the native build where the CPU lends its tiles,
    else the emulated AMX level where this CPU runs it; None where neither (a test of
    those paths then skips: no tiles, and no AVX512-BF16 to emulate them on)."""
    from engine.kernels.cpu import cpu_kernels

    native = cpu_kernels()
    if native is not None and native.amx_tiles == 2:
        return native
    if emulate_amx():
        return kernels_of(request, build_mod.EMULATED_AMX_LEVEL)
    return None


def use_kernels(monkeypatch, kernels) -> None:
    """Every layer of the process sees ``kernels``: the CPU kernels' users (attention,
    the float and quantized Linear layers); loads made after this use them."""
    from engine.kernels import cpu as cpu_mod
    from engine.kernels import quant as quant_mod
    from engine.models import layers as layers_mod

    for module in (cpu_mod, layers_mod, quant_mod):
        monkeypatch.setattr(module, "cpu_kernels", lambda: kernels)
