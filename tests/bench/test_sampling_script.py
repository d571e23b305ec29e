"""scripts/bench_sampling.py: a line per operation with both times and their ratio; a
bad option is one line naming it."""

from __future__ import annotations

import re
import subprocess

from tests.bench.scripts import run_script


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_script("bench_sampling.py", *args)


def test_a_line_per_operation_with_its_ratio():
    done = _run("--rows", "8", "--vocab", "20000", "--rounds", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("[8, 20000] fp32")
    pattern = re.compile(
        r"^  (noise|argmax|race|inverse CDF) +kernel +([0-9.]+) ms +torch +([0-9.]+) ms "
        r"+kernel / torch ([0-9.]+)$"
    )
    rows = [pattern.match(line) for line in lines[1:]]
    assert all(rows), lines
    assert [m.group(1) for m in rows] == ["noise", "argmax", "race", "inverse CDF"]
    for m in rows:
        kernel, torch_ms, ratio = (float(m.group(i)) for i in (2, 3, 4))
        assert kernel > 0 and torch_ms > 0
        assert abs(ratio - kernel / torch_ms) <= 0.002 + 0.05 * ratio  # printed rounded


def test_a_bad_option_is_one_line():
    done = _run("--rows", "0")
    assert done.returncode == 2
    assert "--rows, --vocab and --rounds must be at least 1" in done.stderr
    assert "Traceback" not in done.stderr
