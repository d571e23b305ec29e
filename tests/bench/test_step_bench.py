"""`specserve bench step` on a tiny model: both runs happen, the table adds up, and
every timer it patched in is gone afterwards."""

from __future__ import annotations

import argparse
import os

import engine.models.layers as layers
import engine.models.llama as llama
from engine.benchmarks import step
from engine.kernels.cpu import cpu_kernels


def test_step_breakdown_runs_both_implementations(tiny_model_dir, capsys):
    rms_forward, rope_call, silu = (
        layers.RMSNorm.forward,
        layers.RopeBatch.__call__,
        (llama.silu_and_mul),
    )
    parser = argparse.ArgumentParser()
    step.add_arguments(parser)
    args = parser.parse_args(["--model", tiny_model_dir, "--num-prompts", "3", "--output-len", "5"])
    assert step.run(args) == 0
    out = capsys.readouterr().out
    rows = {
        line.split()[0]: [float(x) for x in line.split()[1:3]]
        for line in out.splitlines()
        if line.split() and line.split()[0] in (*step.COMPONENTS, "step")
    }
    assert set(rows) == {*step.COMPONENTS, "step"}
    for name in ("linear", "lm_head", "attention", "norm_rope_silu", "step"):
        assert rows[name][0] > 0 and rows[name][1] > 0, name
    # the components add up to the step, up to the printed rounding (0.005 ms per value)
    rounding = 0.005 * (len(step.COMPONENTS) + 1) + 1e-6
    for col in (0, 1):
        total = sum(rows[name][col] for name in step.COMPONENTS)
        assert abs(total - rows["step"][col]) < rounding + 0.01 * rows["step"][col]
    assert "decode throughput" in out
    # nothing left patched, the environment and the kernel switch as before
    assert layers.RMSNorm.forward is rms_forward and layers.RopeBatch.__call__ is rope_call
    assert llama.silu_and_mul is silu
    assert "SPECSERVE_CPU_KERNELS" not in os.environ
    assert cpu_kernels() is not None
