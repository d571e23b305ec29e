"""The instruction-set levels kernel tests run at: the -march=native build, then every
prebuilt level (engine/kernels/build.py) this CPU can execute, best first. The prebuilt
libraries are compiled once per test session (``prebuilt_kernel_levels`` in
tests/conftest.py), shared by every module that runs at each level."""

from __future__ import annotations

import platform

from engine.kernels import build as build_mod


def runnable_levels() -> list[str]:
    have = build_mod.cpu_flags()
    levels = build_mod.PREBUILT_LEVELS.get(platform.machine(), [])
    return ["native"] + [level for level, needs in levels if needs <= have]


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


def use_kernels(monkeypatch, kernels) -> None:
    """Every layer of the process sees ``kernels``: the CPU kernels' users (attention,
    the float and quantized Linear layers); loads made after this use them."""
    from engine.kernels import cpu as cpu_mod
    from engine.kernels import quant as quant_mod
    from engine.models import layers as layers_mod

    for module in (cpu_mod, layers_mod, quant_mod):
        monkeypatch.setattr(module, "cpu_kernels", lambda: kernels)
