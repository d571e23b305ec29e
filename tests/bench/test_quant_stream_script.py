"""scripts/bench_quant_stream.py: a row per row count with every build's time, rate and
ratio to the first build, the builds' bits checked equal on the way; with --base, the
working tree's build of each level beside the revision's; a bad option, or a level this
CPU cannot run, is one line naming it."""

from __future__ import annotations

import subprocess

import pytest

from engine.kernels import build
from engine.kernels.cpu import cpu_kernels
from tests.bench.scripts import run_script


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_script("bench_quant_stream.py", *args)


def _rows(done) -> list[list[str]]:
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    header, *rows = lines
    assert header.startswith("| rows |"), done.stdout
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows]


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_one_build_a_row_per_row_count(fmt):
    if cpu_kernels() is None:
        pytest.fail("CPU kernels failed to build; CI machines have gcc")
    done = _run("--rows", "1,7", "--layers", "3", "--rounds", "2", "--shape", "64x96",
                "--format", fmt)  # fmt: skip
    cells = _rows(done)
    assert [c[0] for c in cells] == ["1", "7"], done.stdout
    for c in cells:
        assert len(c) == 3 and float(c[1]) > 0 and float(c[2]) > 0, c
    assert f"{fmt} [64, 96], 3 weights" in done.stdout


def test_the_working_tree_against_a_revision():
    """--base HEAD: the native build and HEAD's side by side, the same bits (the script
    stops with code 2 where they differ), HEAD's ratio to native."""
    if cpu_kernels() is None:
        pytest.fail("CPU kernels failed to build; CI machines have gcc")
    done = _run("--base", "HEAD", "--rows", "1,7", "--layers", "2", "--rounds", "2",
                "--shape", "64x64")  # fmt: skip
    cells = _rows(done)
    assert "| rows | native us | HEAD us | native GB/s | HEAD GB/s | HEAD / native |" in (
        done.stdout
    )
    for c in cells:
        assert len(c) == 6 and float(c[5]) > 0, c


def test_a_revision_is_built_at_each_level_asked_for():
    """--levels L --base HEAD: the working tree's build of level L beside HEAD's build of
    the same level (not HEAD's native build), the same bits, one ratio."""
    from tests.engine.kernel_levels import runnable_levels

    prebuilt = runnable_levels()[1:]  # best first: the last is x86-64-v2 on any x86-64
    assert prebuilt, "no prebuilt kernel level for this machine"
    level = prebuilt[-1]
    done = _run("--levels", level, "--base", "HEAD", "--rows", "1,5", "--layers", "2",
                "--rounds", "2", "--shape", "48x64")  # fmt: skip
    cells = _rows(done)
    header = f"| rows | {level} us | {level} HEAD us | {level} GB/s | {level} HEAD GB/s |"
    assert header in done.stdout, done.stdout
    assert [c[0] for c in cells] == ["1", "5"], done.stdout
    assert f"building the kernels at HEAD for {level}" in done.stderr


@pytest.mark.parametrize(
    ("option", "value"),
    [("--rows", "0"), ("--shape", "64x33"), ("--levels", "x86-64-v9"), ("--layers", "0")],
)
def test_a_bad_value_is_one_line_naming_the_option(option, value):
    done = _run(option, value)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert option in last and value in last, done.stderr
    assert "Traceback" not in done.stderr


def test_a_level_this_cpu_cannot_run_is_refused_by_name():
    beyond = [name for name, flags in build.PREBUILT_LEVELS.get(build.platform.machine(), [])
              if not flags <= build.cpu_flags()]  # fmt: skip
    if not beyond:
        pytest.skip("this CPU runs every prebuilt level")
    done = _run("--levels", f"native,{beyond[0]}")
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert "cannot run" in last and beyond[0] in last, done.stderr
