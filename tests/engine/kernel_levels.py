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
