"""`specserve bench step --dtype`: the bf16 run loads the model in bf16 for both
implementations, and an unknown dtype is refused by the parser."""

from __future__ import annotations

import argparse

import pytest
import torch

from engine.benchmarks import step
from engine.kernels.cpu import CpuKernels
from engine.kernels.cpu import cpu_kernels as step_kernels


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    step.add_arguments(parser)
    return parser


def test_bf16_step_breakdown(tiny_model_dir, capsys, monkeypatch):
    seen: list[torch.dtype] = []
    rms_norm = CpuKernels.rms_norm

    def recording(self, x, *args, **kwargs):
        seen.append(x.dtype)
        return rms_norm(self, x, *args, **kwargs)

    monkeypatch.setattr(CpuKernels, "rms_norm", recording)
    args = _parser().parse_args(
        [
            "--model",
            tiny_model_dir,
            "--num-prompts",
            "2",
            "--output-len",
            "3",
            "--dtype",
            "bfloat16",
        ]
    )
    assert step.run(args) == 0
    out = capsys.readouterr().out
    assert "(chat, bfloat16, " in out and "decode throughput" in out
    assert seen and set(seen) == {torch.bfloat16}  # the kernel run computed in bf16
    # the breakdown timed the layers one by one (a fused run would leave linear at 0)
    linear_row = next(line for line in out.splitlines() if line.startswith("linear"))
    assert float(linear_row.split()[1]) > 0
    if step_kernels().has_bf16_linear:
        assert "one-call decoder (bf16 layers in one kernel call): step" in out


def test_dtype_defaults_to_float32_and_is_checked(capsys):
    assert _parser().parse_args([]).dtype == "float32"
    with pytest.raises(SystemExit):
        _parser().parse_args(["--dtype", "float16"])
    assert "invalid choice: 'float16'" in capsys.readouterr().err
