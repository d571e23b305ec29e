"""`specserve bench bounds`: the read bandwidth and multiply-add peaks printed beside
every benchmark table."""

from __future__ import annotations

import json
import platform

import pytest

from engine.benchmarks.bounds import Bounds
from engine.entrypoints.cli import main
from engine.kernels.build import cpu_flags
from engine.kernels.cpu import cpu_kernels


def test_bounds_are_measured_and_plausible(tmp_path, capsys):
    if cpu_kernels() is None:
        pytest.skip("no C compiler: the bounds need the CPU kernels")
    out = tmp_path / "bounds.json"
    assert main(["bench", "bounds", "--num-threads", "1", "--json", str(out)]) == 0
    b = json.loads(out.read_text())
    assert b["num_threads"] == 1
    assert 0.5 < b["read_gbps"] < 1000  # any machine this runs on
    if platform.machine() == "x86_64" and "fma" in cpu_flags():
        assert 1 < b["fp32_fma_gmacs"] < 1000
    # Measured, not assumed: how they compare with fp32 FMA depends on the core (Zen 4:
    # vdpbf16ps ~2x FMA, vpdpbusd ~1.8x; a Xeon with AMX: vdpbf16ps 0.5x, vpdpbusd 2x).
    if "avx512_bf16" in cpu_flags():
        assert 1 < b["bf16_gmacs"] < 4 * b["fp32_fma_gmacs"]
    if "avx512_vnni" in cpu_flags() or "avx_vnni" in cpu_flags():
        assert 1 < b["int8_gmacs"] < 8 * b["fp32_fma_gmacs"]
    line = capsys.readouterr().out.strip()
    assert line.startswith("machine bounds (1 threads): read ") and "fp32 FMA" in line


def test_a_missing_instruction_says_n_a_and_bad_flags_are_one_line(capsys):
    line = Bounds(2, 30.0, 100.0, None, 200.0).line()
    assert line == (
        "machine bounds (2 threads): read 30.0 GB/s; multiply-add peaks (G/s) fp32 FMA 100, "
        "bf16 vdpbf16ps n/a, int8 vpdpbusd 200"
    )
    assert main(["bench", "bounds", "--num-threads", "0"]) == 2
    assert capsys.readouterr().err.strip() == "--num-threads must be >= 1, got 0"


def test_amx_and_avx2_int8_peaks_are_measured_where_they_exist(prebuilt_kernel_levels):
    """Issue 35: `bench bounds` measured no int8 peak on AVX2 without VNNI, and none for
    AMX. The AVX2 level (run here on whatever x86-64 CPU has AVX2) measures the
    vpmaddubsw + vpaddw step and says so; a CPU with AMX and a build with the tile path measures
    tdpbssd, well above vpdpbusd, and with AMX-BF16 tdpbf16ps, well above vdpbf16ps."""
    from engine.benchmarks.bounds import int8_instruction, measure
    from engine.kernels.cpu import CpuKernels, cpu_kernels
    from engine.kernels.quant import quant_ops

    if platform.machine() != "x86_64" or "avx2" not in cpu_flags():
        pytest.skip("the AVX2 level needs an x86-64 CPU with AVX2")
    v3 = CpuKernels(prebuilt_kernel_levels["x86-64-v3"])
    assert int8_instruction(v3) == "vpmaddubsw"
    assert (v3.peak_gmacs(2, 200_000, 1) or 0) > 1
    assert v3.peak_gmacs(4, 1000, 1) is None  # no AMX in an AVX2 build
    assert v3.peak_gmacs(5, 1000, 1) is None
    ops = quant_ops()
    has_amx = {"amx_int8", "amx_tile"} <= cpu_flags() and ops is not None
    amx_int8 = has_amx and ops.amx_min_rows != 0
    amx_bf16 = "amx" in cpu_kernels().bf16_linear_modes
    b = measure(1) if amx_int8 or amx_bf16 else None
    if amx_int8:
        assert b.amx_int8_gmacs is not None and b.amx_int8_gmacs > 2 * b.int8_gmacs
        assert "int8 AMX tdpbssd" in b.line()
    if amx_bf16:  # the bf16 tiles' peak beside vdpbf16ps's
        assert b.amx_bf16_gmacs is not None and b.amx_bf16_gmacs > 2 * b.bf16_gmacs
        assert "bf16 AMX tdpbf16ps" in b.line()
