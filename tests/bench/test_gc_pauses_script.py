"""scripts/gc_pauses.py: ``heap`` freezes what an engine's start-up left and times full
collections either side (on a tiny model through the real loading code); ``run`` runs a
specserve command in its process and reports each generation's collections at exit; a
``run`` without a command is one line saying what it needs."""

from __future__ import annotations

import re
import subprocess

from tests.bench.scripts import run_script


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_script("gc_pauses.py", *args, timeout=300)


def test_heap_freezes_the_engine_and_times_collections_either_side(tiny_model_dir):
    done = _run("heap", "--model", tiny_model_dir)
    assert done.returncode == 0, done.stderr[-2000:]
    tracked = int(re.search(r"^objects tracked: (\d+)$", done.stdout, re.M).group(1))
    frozen = int(re.search(r"^frozen: (\d+) objects$", done.stdout, re.M).group(1))
    # the script counts before it times collections: the few objects it makes between
    # (its list of timings) can be frozen too, where the collections found no garbage
    assert 1000 < frozen <= tracked + 50
    for label in ("full collection ms", "full collection ms, frozen"):
        times = re.search(rf"^{label}: (.+)$", done.stdout, re.M).group(1).split(", ")
        assert len(times) == 3 and all(float(t) >= 0 for t in times)


def test_run_reports_every_generation_at_exit():
    done = _run("run", "--version")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "specserve" in done.stdout
    assert re.search(r"^gc: gen 0: \d+ in [\d.]+ ms; gen 1: .*; gen 2: .*$", done.stderr, re.M)


def test_run_without_a_command_is_one_line():
    done = _run("run")
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith("run needs a specserve command, e.g. run serve --port 50061")
    )
