"""The float32 Linear kernel (engine/kernels/cpu_kernels.c, issue 35 item 1) at every
instruction-set level this CPU executes: each output is exactly the chain
acc = fma(w[j], x[j], acc) over j in order, from zero, then + bias (checked bit for bit
against that chain computed in float64, which is exact for the product), whatever the
rows around it, the thread count or the level; weights stored as bf16 give the bits
fp32 storage gives for the same values; levels without FMA refuse it in one line."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import CpuKernels
from tests.engine.kernel_levels import kernels_at_level, runnable_levels
from tests.engine.test_cpu_kernels import (
    check_linear_rows_do_not_depend_on_the_batch,
    check_linear_takes_strided_rows,
    same_bits,
)

STORAGES = [
    pytest.param(torch.float32, id="fp32-stored"),
    pytest.param(torch.bfloat16, id="bf16-stored"),
]


@pytest.fixture(scope="module", params=runnable_levels())
def level_kernels(request) -> CpuKernels:
    return kernels_at_level(request)


@pytest.fixture(scope="module")
def kernels(level_kernels) -> CpuKernels:
    if not level_kernels.has_f32_linear:
        pytest.skip("a level without FMA: float32 Linear layers stay on oneDNN (tested below)")
    return level_kernels


def fma_chain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 acc = fma(w[j], x[j], acc) for j = 0..k-1, then + bias: the product of two
    float32 numbers is exact in float64, so each step rounds once to float64 and once to
    float32 (a double rounding that differs from fma's one rounding with probability
    ~2^-29 a step; the seeds are fixed)."""
    w, xs = weight.double(), x.double()
    acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32)
    for j in range(x.shape[1]):
        acc = (xs[:, j : j + 1] * w[:, j] + acc.double()).float()
    return acc if bias is None else acc + bias


def _weight(n: int, k: int, storage: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    weight = torch.randn(n, k, generator=gen) / k**0.5
    return weight.to(torch.bfloat16).float() if storage is torch.bfloat16 else weight


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize(
    ("n", "k", "with_bias"),
    [(64, 64, False), (70, 37, True), (5, 2, True), (96, 1, False), (33, 200, True)],
)
@pytest.mark.parametrize("rows", [1, 5, 7, 13, 30])  # past 6- and 12-row register blocks
def test_linear_f32_is_the_fma_chain_bit_for_bit(kernels, storage, n, k, with_bias, rows):
    """Outputs past a tile (16 or 32 wide), odd k (a bf16 pair's padding, never
    multiplied), one column."""
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    weight = _weight(n, k, storage, gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    x = torch.randn(rows, k, generator=gen)
    packed = kernels.pack_linear_weight(weight, storage)
    assert packed.dtype is storage
    out = kernels.linear(x, packed, bias, n)
    assert same_bits(out, fma_chain(x, weight, bias))


def test_bf16_storage_gives_the_bits_of_fp32_storage(kernels):
    gen = torch.Generator().manual_seed(3)
    n, k = 100, 77
    weight = _weight(n, k, torch.bfloat16, gen)
    bias, x = torch.randn(n, generator=gen), torch.randn(29, k, generator=gen)
    as_f32 = kernels.linear(x, kernels.pack_linear_weight(weight), bias, n)
    as_bf16 = kernels.linear(x, kernels.pack_linear_weight(weight, torch.bfloat16), bias, n)
    assert same_bits(as_f32, as_bf16)
    bf16_bytes = kernels.pack_linear_weight(weight, torch.bfloat16).numel() * 2
    assert bf16_bytes <= 0.51 * kernels.pack_linear_weight(weight).numel() * 4  # half the bytes


@pytest.mark.parametrize("storage", STORAGES)
def test_linear_f32_rows_do_not_depend_on_the_batch(kernels, storage):
    """A row alone, in every position of batches of 1 to 40 rows, on 1 thread and on 2:
    the same bits (float32 greedy output with and without speculation, and seeded
    output alone and in a crowd, rest on it)."""
    gen = torch.Generator().manual_seed(5)
    n, k = 100, 96
    weight = _weight(n, k, storage, gen)
    bias = torch.randn(n, generator=gen)
    packed = kernels.pack_linear_weight(weight, storage)
    check_linear_rows_do_not_depend_on_the_batch(kernels, packed, bias, k, gen)


def test_every_level_computes_the_same_bits(request):
    """The AVX2 and AVX512 builds (tiles of 16 and 32) agree bit for bit: a fleet of
    mixed CPUs serves one seeded request the same way."""
    gen = torch.Generator().manual_seed(11)
    weight, x, bias = torch.randn(50, 45, generator=gen), torch.randn(9, 45, generator=gen), None
    expected = fma_chain(x, weight, bias)
    ran = []
    for level in runnable_levels():
        request.param = level  # kernels_at_level reads the level as a fixture param
        kernels = kernels_at_level(request)
        if kernels.has_f32_linear:
            out = kernels.linear(x, kernels.pack_linear_weight(weight), bias, 50)
            assert same_bits(out, expected), level
            ran.append(kernels.linear_tiles[torch.float32])
    assert ran


def test_linear_f32_takes_strided_rows(kernels):
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(40, 24, generator=gen)
    packed = kernels.pack_linear_weight(weight)
    check_linear_takes_strided_rows(kernels, packed, gen, torch.float32)


def test_linear_f32_refuses_what_does_not_fit(kernels):
    weight = torch.randn(40, 24)
    packed = kernels.pack_linear_weight(weight)
    x = torch.randn(3, 24)
    tile = kernels.linear_tiles[torch.float32]
    with pytest.raises(ValueError, match=r"packed .* is not a packed \[.*, 24\] weight"):
        kernels.linear(x, packed, None, 40 + 2 * tile)
    with pytest.raises(ValueError, match=r"packed .* is not a packed \[40, 26\] weight"):
        kernels.linear(torch.randn(3, 26), packed, None, 40)
    with pytest.raises(ValueError, match=r"bias \[39\] != out_features 40"):
        kernels.linear(x, packed, torch.zeros(39), 40)
    with pytest.raises(ValueError, match="bias is torch.bfloat16 but x is torch.float32"):
        kernels.linear(x, packed, torch.zeros(40, dtype=torch.bfloat16), 40)
    with pytest.raises(
        ValueError, match="a torch.bfloat16 weight cannot be stored as torch.float32"
    ):
        kernels.pack_linear_weight(weight.to(torch.bfloat16), torch.float32)
    with pytest.raises(ValueError, match="weight must be a 2-D float32 or bfloat16 CPU tensor"):
        kernels.pack_linear_weight(weight[None])
    assert kernels.linear(x[:0], packed, None, 40).shape == (0, 40)


def test_bf16_on_fma_is_the_fma_chain_rounded_once(kernels):
    """The FMA bf16 Linear kernel: bf16 x and weights widened (exact), the fp32 kernel's
    chain, + bias, rounded to bf16 once; at every level that has FMA."""
    if "fma" not in kernels.bf16_linear_modes:
        pytest.fail("a level with FMA builds the FMA bf16 Linear kernel")
    before = kernels.set_bf16_linear("fma")
    try:
        gen = torch.Generator().manual_seed(9)
        for n, k, rows in [(70, 37, 13), (33, 64, 1), (5, 2, 7)]:
            weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
            bias = torch.randn(n, generator=gen).to(torch.bfloat16)
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            out = kernels.linear(x, kernels.pack_linear_weight(weight), bias, n)
            expected = fma_chain(x.float(), weight.float(), bias.float()).to(torch.bfloat16)
            assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    finally:
        if before is not None:
            kernels.set_bf16_linear(before)


def test_the_bf16_kernel_is_picked_by_measured_peaks_or_by_name(kernels, monkeypatch, caplog):
    if not {"vdpbf16ps", "fma"} <= set(kernels.bf16_linear_modes):
        pytest.skip("one bf16 Linear kernel at this level: nothing to pick")
    have = list(kernels.bf16_linear_modes)
    # where AMX is lent it wins; without it, the faster of the two vector kernels
    monkeypatch.setattr(kernels, "bf16_linear_modes", ["vdpbf16ps", "fma", "amx"])
    with caplog.at_level("INFO", logger="engine.kernels.cpu"):
        assert kernels._pick_bf16_linear() == "amx"
    assert "bf16 Linear layers on AMX tiles" in caplog.text
    monkeypatch.setattr(kernels, "bf16_linear_modes", ["vdpbf16ps", "fma"])
    peaks = {0: 250.0, 1: 123.0}  # fp32 FMA, vdpbf16ps: the Xeon with AMX
    monkeypatch.setattr(kernels, "_peak_gmacs", lambda kind, iters, threads: peaks[kind])
    with caplog.at_level("INFO", logger="engine.kernels.cpu"):
        assert kernels._pick_bf16_linear() == "fma"
    assert "bf16 Linear layers on the fma kernel" in caplog.text  # the start-up log says
    peaks.update({0: 110.0, 1: 220.0})  # a Zen 4
    assert kernels._pick_bf16_linear() == "vdpbf16ps"
    monkeypatch.setattr(kernels, "bf16_linear_modes", have)
    monkeypatch.setenv("SPECSERVE_BF16_LINEAR", "fma")
    assert kernels._pick_bf16_linear() == "fma"
    monkeypatch.setenv("SPECSERVE_BF16_LINEAR", "sme")
    listed = ", ".join(have)
    with pytest.raises(ValueError, match=rf"SPECSERVE_BF16_LINEAR=sme: .* they have: {listed}$"):
        kernels._pick_bf16_linear()


def test_a_level_without_fma_refuses_in_one_line(level_kernels):
    if level_kernels.has_f32_linear:
        pytest.skip("this level has FMA")
    with pytest.raises(
        RuntimeError, match=r"float32 linear kernel needs a build for a CPU with FMA"
    ):
        level_kernels.pack_linear_weight(torch.randn(4, 4))
