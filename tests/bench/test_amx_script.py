"""scripts/bench_amx.py: on a CPU and build with AMX-INT8, a row per format, shape and
row count with every column filled (and the base revision's column with --base, the
bf16 tiles' with --bf16); where there is no AMX path, the one line that says so; a bad
option is one line naming it."""

from __future__ import annotations

import subprocess

import pytest

from engine.kernels.quant import quant_ops
from tests.bench.scripts import run_script


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_script("bench_amx.py", *args)


def _amx() -> bool:
    ops = quant_ops()
    return ops is not None and ops.amx_min_rows != 0


@pytest.mark.parametrize("base", [None, "HEAD"])
def test_a_row_for_each_format_shape_and_row_count(base):
    args = ["--rounds", "1", "--calls", "2", "--rows", "1,17", "--shapes", "64x64,32x96"]
    done = _run(*args, *(["--base", base] if base else []))
    _check_table(done, base, bf16=False)


@pytest.mark.parametrize("base", [None, "HEAD"])
def test_the_bf16_tile_column(base):
    """--bf16 adds the path's time and its ratio to the faster int8 path; with --base,
    the base revision's path too (and its ratio to it)."""
    done = _run("--rounds", "1", "--calls", "2", "--rows", "1,17", "--shapes", "64x64,32x96",
                "--bf16", *(["--base", base] if base else []))  # fmt: skip
    if _amx() and not quant_ops().bf16_tiles:
        assert done.returncode == 1 and "no bf16-tile path" in done.stdout, done.stdout
        return
    _check_table(done, base, bf16=True)


def _check_table(done, base, bf16: bool) -> None:
    if not _amx():
        assert done.returncode == 1, done.stderr[-2000:]
        assert done.stdout.strip() == (
            "this build of the kernels has no AMX path (a CPU without AMX-INT8)"
        )
        return
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| Q")]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    got = [(c[0], c[1], c[2]) for c in cells]
    assert got == [(f, s, m) for f in ("Q4_1", "Q8_0") for s in ("[64, 64]", "[32, 96]")
                   for m in ("1", "17")], done.stdout  # fmt: skip
    for c in cells:
        assert len(c) == 7 + 2 * bool(base) + 2 * bf16 + 2 * (bf16 and bool(base)), c
        assert float(c[3]) > 0 and float(c[4]) > 0 and c[5].endswith("x"), c
        if base:
            assert float(c[7]) > 0 and float(c[8]) > 0, c
        if bf16:
            t, ratio = (c[-4], c[-3]) if base else (c[-2], c[-1])
            assert float(t) > 0 and ratio.endswith("x") and float(ratio[:-1]) > 0, c
        if bf16 and base:
            assert float(c[-2]) > 0 and float(c[-1]) > 0, c


@pytest.mark.parametrize(
    "args", [["--shapes", "64x60"], ["--rows", "0"], ["--rows", "a"], ["--calls", "0"]]
)
def test_a_bad_option_is_one_line(args):
    done = _run(*args)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("bench_amx.py: error:"), done.stderr
