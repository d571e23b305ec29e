"""scripts/bench_fused_decoder.py: every variant its options name gets a row, alternated
in one process, on a tiny model through the real loading code; a bad option value is one
line naming the option."""

from __future__ import annotations

import os
import subprocess

import pytest

from engine.kernels.cpu import cpu_kernels
from tests.bench.scripts import run_script
from tests.tiny_models import make_tiny_model


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_script("bench_fused_decoder.py", *args)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), num_hidden_layers=2)


def test_every_variant_gets_a_row(tiny):
    if cpu_kernels() is None:
        pytest.fail("CPU kernels failed to build; CI machines have gcc")
    done = _run("--model", tiny, "--dtype", "float32", "--levels", "native", "--rounds", "2",
                "--context", "40", "--team", "on,off", "--kv-cache-dtype", "auto,bfloat16",
                "--kv-hugepages", "on,off", "--scatter")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| native")]
    if len(rows) == 1 and "no one-call decoder" in rows[0]:
        pytest.skip("this kernel level has no one-call float32 decoder")
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    got = {(c[1], c[2], c[3]) for c in cells}
    want = {(kv, team, page) for kv in ("float32", "bfloat16") for team in ("on", "off")
            for page in ("on", "off")}  # fmt: skip
    assert got == want and len(rows) == len(want), done.stdout
    for c in cells:
        one_call, vs_first, layers = float(c[4]), float(c[5]), float(c[6])
        assert one_call > 0 and layers > 0 and vs_first > 0, c
        assert "% of" in c[8] and "% of" in c[9], c
    # the first variant is the reference of "vs first"
    assert cells[0][5] == "1.000", cells[0]


def test_a_batch_decodes_every_sequence_in_one_step(tiny):
    """--batch 3: each timed step decodes three sequences of 40 tokens' context, a bf16
    model (the bf16 decoder's team); the step the script prepares says so, and the
    table's row comes out."""
    if cpu_kernels() is None:
        pytest.fail("CPU kernels failed to build; CI machines have gcc")
    done = _run("--model", tiny, "--levels", "native", "--rounds", "2", "--context", "40",
                "--dtype", "bfloat16", "--batch", "3")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    [row] = [line for line in done.stdout.splitlines() if line.startswith("| native")]
    if "no one-call decoder" in row:
        pytest.skip("this kernel level has no one-call bf16 decoder")
    assert "native: each step decodes 3 sequences, 123 positions of K/V" in done.stderr
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[4]) > 0 and float(cells[6]) > 0, row


@pytest.mark.parametrize(
    ("option", "value"),
    [("--team", "maybe"), ("--kv-hugepages", "2mb"), ("--batch", "0"), ("--levels", "x86-64-v9")],
)
def test_a_bad_value_is_one_line_naming_the_option(option, value):
    done = _run(option, value, "--rounds", "1")
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert option in last and value in last, done.stderr
    assert "Traceback" not in done.stderr


def test_native_listed_after_a_prebuilt_level_runs_the_native_build(tiny):
    """Each level runs its own build, whatever the order of --levels: the script once
    took the native build from a lookup it had already pointed at the level before,
    so `--levels x86-64-v3,native` timed the AVX2 code twice."""
    from pathlib import Path

    from engine.kernels import build

    if cpu_kernels() is None:
        pytest.fail("CPU kernels failed to build; CI machines have gcc")
    other = "x86-64-v3" if build.level_flags("x86-64-v3") <= build.cpu_flags() else "x86-64-v2"
    done = _run("--model", tiny, "--dtype", "float32", "--levels", f"{other},native",
                "--rounds", "1", "--context", "20")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    libs = dict(line.split(": kernels ") for line in done.stderr.splitlines()
                if ": kernels " in line)  # fmt: skip
    assert libs["native"] == Path(cpu_kernels().lib._name).name, done.stderr
    assert other in libs[other] and libs[other] != libs["native"], libs


def test_a_level_this_cpu_cannot_run_is_refused_by_name():
    """A prebuilt level beyond this CPU is one line naming it, not an illegal
    instruction: the script once ran such a level's code and died of SIGILL."""
    from engine.kernels import build

    beyond = [name for name, flags in build.PREBUILT_LEVELS.get(build.platform.machine(), [])
              if not flags <= build.cpu_flags()]  # fmt: skip
    if not beyond:
        pytest.skip("this CPU runs every prebuilt level")
    done = _run("--levels", f"native,{beyond[0]}", "--rounds", "1")
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "cannot run" in last and beyond[0] in last, done.stderr
    assert "Traceback" not in done.stderr


def test_waits_name_every_barrier_site_of_the_team(tiny):
    """--waits: a build with the team's barriers timed; after the times, a row per
    barrier site the step passed, named by the statement before it, with its calls a
    step (the per-layer sites once a layer: 2 here) and each thread's wait, and a total
    that is each thread's share of the step."""
    if cpu_kernels() is None:
        pytest.fail("CPU kernels failed to build; CI machines have gcc")
    done = _run("--model", tiny, "--dtype", "float32", "--levels", "native", "--rounds", "3",
                "--context", "40", "--waits")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    if "no one-call decoder" in done.stdout:
        pytest.skip("this kernel level has no one-call float32 decoder")
    out = done.stdout
    assert "team waits, native, KV cache auto, team on, huge pages on: a step of" in out, out
    if "(no step ran on the team)" in out:  # one thread: the team never runs
        assert (os.cpu_count() or 1) < 2, out
        return
    rows = [line for line in out.splitlines() if line.startswith("| ") and "`" in line]
    cells = {
        c[1].strip("`"): c for c in ([x.strip() for x in r.strip("|").split("|")] for r in rows)
    }
    linear = [name for name in cells if name.startswith("team_linear_##S(")]
    assert len(linear) >= 4 and any(n.startswith("attn_items_##V(") for n in cells), out
    threads = len(next(iter(cells.values()))) - 3
    assert threads >= 2, out
    for name in linear[:4]:  # qkv, o, gate_up, down: once a layer
        assert float(cells[name][2]) == 2, cells[name]
    for c in cells.values():
        assert all(float(us) >= 0 for us in c[3:]), c
    [total] = [line for line in out.splitlines() if line.startswith("| all |")]
    shares = [c.strip() for c in total.strip("|").split("|")][3:]
    assert len(shares) == threads and all(s.endswith("%)") for s in shares), total
