"""The compiled CPU kernels against plain torch references, in float32 and bfloat16.

bfloat16 tolerances: the residual add, rotary and SiLU-and-mul are bit-identical to
torch's bfloat16 ops (SiLU over every bfloat16 input). RMSNorm sums its squares in
another order than torch's reduction, so a row's fp32 scale can differ in its last bit
and put a few elements (about 1 in 10^5) on the other side of a bfloat16 rounding
boundary: at most 2 ulps (the rounded normalised value, then times the weight), in at
most 1 in 1000 elements. Attention is computed in fp32 and rounded once, so it is held
to the exact (fp32) attention of its bfloat16 inputs within half a bfloat16 ulp,
rtol 2^-8, plus fp32 summation error.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import build as build_mod
from engine.kernels import cpu as cpu_mod
from engine.kernels.cpu import CpuKernels, KernelBuildError, build_library, cpu_kernels
from engine.models.layers import RMSNorm, apply_rope
from tests.engine.kernel_levels import amx_kernels

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
]
# (rows' dtype, KV cache's dtype): the model's dtype for both, or float32 rows over a
# bfloat16 cache (--kv-cache-dtype bfloat16)
KV_DTYPES = [
    pytest.param((torch.float32, torch.float32), id="fp32"),
    pytest.param((torch.bfloat16, torch.bfloat16), id="bf16"),
    pytest.param((torch.float32, torch.bfloat16), id="fp32-bf16kv"),
]
# bf16 attention: half an ulp of rounding (<= 2^-8 relative) plus fp32 sums
BF16_ATTENTION_TOL = {"rtol": 4e-3, "atol": 1e-5}


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    k = cpu_kernels()
    if k is None:  # CI machines have gcc: a missing kernel here is a failure, not a skip
        pytest.fail("CPU kernels failed to build; see the warning logged by cpu_kernels()")
    return k


def _reference_attention(q, k_cache, v_cache, tables, seq_lens, q_lens, scale):
    """Per sequence: gather its context, causal-with-offset softmax attention, GQA."""
    outs = []
    start = 0
    group = q.shape[1] // k_cache.shape[2]
    for table, s_len, q_len in zip(tables, seq_lens, q_lens, strict=True):
        keys = torch.cat([k_cache[b] for b in table])[:s_len]  # [s, kvh, hd]
        vals = torch.cat([v_cache[b] for b in table])[:s_len]
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [h, s, hd]
        vals = vals.repeat_interleave(group, dim=1).transpose(0, 1)
        qs = q[start : start + q_len].transpose(0, 1)  # [h, q, hd]
        scores = qs @ keys.transpose(1, 2) * scale  # [h, q, s]
        qpos = torch.arange(s_len - q_len, s_len)[:, None]
        scores = scores.masked_fill(torch.arange(s_len)[None, :] > qpos, float("-inf"))
        outs.append((scores.softmax(-1) @ vals).transpose(0, 1))  # [q, h, hd]
        start += q_len
    return torch.cat(outs)


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """bfloat16 bit patterns as integers in the order of the values (+0 and -0 equal)."""
    bits = t.view(torch.int16).int()
    return torch.where(bits < 0, -(bits + 32768), bits)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (torch.equal takes -0.0 for 0.0)."""
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def assert_bf16_close(out, expected, max_ulps: int, max_fraction: float) -> None:
    """Every element within ``max_ulps`` bfloat16 ulps, and at most ``max_fraction`` of
    them different at all."""
    assert out.dtype == expected.dtype == torch.bfloat16 and out.shape == expected.shape
    ulps = (_ordered(out) - _ordered(expected)).abs()
    assert ulps.numel() == 0 or int(ulps.max()) <= max_ulps
    assert int((ulps > 0).sum()) <= max_fraction * ulps.numel()


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's torch path (RMSNorm._norm) in x's dtype."""
    norm = RMSNorm(x.shape[1], eps).to(x.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm._norm(x)


@pytest.mark.parametrize("dtypes", KV_DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "q_lens", "seq_lens"),
    [
        (9, 3, 64, [1, 1, 1, 1], [1, 17, 40, 64]),  # decode, GQA 3, block boundaries
        (4, 4, 16, [1, 5, 3], [33, 5, 19]),  # verification-sized queries, MHA
        (8, 2, 32, [16, 1, 7], [16, 50, 7]),  # a whole-prompt prefill beside decodes
        # bf16 sends every query to the kernel: long prefills and chunks beside decodes
        (4, 2, 16, [40, 1, 17, 33], [40, 30, 60, 33]),
        (9, 3, 64, [1, 100], [70, 130]),
        (2, 1, 16, [32, 64, 65], [32, 70, 65]),  # whole query tiles and one token over
        # bf16 vdpbf16ps path: head sizes 32 / 64 / 128, GQA 4 (two passes of 2 rows at
        # 128), and enough sequences that a work item takes every KV head
        (32, 8, 128, [1, 1, 4], [5, 47, 33]),
        (8, 8, 32, [1, 3, 1, 1, 2, 1, 1, 1, 1, 1], [2, 18, 31, 64, 16, 17, 1, 80, 33, 9]),
        (9, 3, 64, [1] * 9 + [5], [3, 15, 16, 17, 31, 32, 33, 70, 100, 20]),
    ],
)
def test_paged_attention_matches_reference(
    kernels, heads, kv_heads, head_dim, q_lens, seq_lens, dtypes
):
    dtype, kv_dtype = dtypes
    gen = torch.Generator().manual_seed(0)
    block_size, num_blocks = 16, 32
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(kv_dtype)
    free = torch.randperm(num_blocks - 1, generator=gen).add(1).tolist()  # shuffled, no 0
    tables = [[free.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
    width = max(map(len, tables))
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    # Queries live inside a wider fused buffer, like the q heads of a qkv projection.
    num_tokens = sum(q_lens)
    fused = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = fused[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = head_dim**-0.5
    out = torch.full((num_tokens, heads, head_dim), float("nan"), dtype=dtype)
    kernels.paged_attention(
        out,
        q,
        k_cache,
        v_cache,
        table_t,
        torch.tensor(seq_lens, dtype=torch.int32),
        qsl,
        torch.arange(len(q_lens), dtype=torch.int32),
        max(q_lens),
        scale,
    )
    # fp32 reference of the values as stored
    expected = _reference_attention(
        q.float(), k_cache.float(), v_cache.float(), tables, seq_lens, q_lens, scale
    )
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), expected, **BF16_ATTENTION_TOL)


def _decode_attention(kernels, q, k_cache, v_cache, tables, seq_lens):
    """One decode token per sequence, bf16, block size from the cache."""
    n = len(seq_lens)
    out = torch.empty_like(q)
    width = max(map(len, tables))
    kernels.paged_attention(
        out, q, k_cache, v_cache,
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32), torch.arange(n + 1, dtype=torch.int32),
        torch.arange(n, dtype=torch.int32), 1, q.shape[-1] ** -0.5,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_bf16_attention_ignores_unwritten_slots_and_the_batch(kernels, block_size):
    """The bf16 path reads all 16 slots of a block's stretch of keys, written or not, and
    works on several rows and KV heads per pass. Slots past a sequence's length hold NaN
    here (a freed sequence's values could be anything): no output may see them. And a
    sequence's rows are bit-identical alone (one work item per KV head) and in a crowd
    of 12 (one item per sequence), at block sizes below, at and above 16."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, num_blocks = 9, 3, 64, 160
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=torch.bfloat16)
    v_cache = torch.full(shape, float("nan"), dtype=torch.bfloat16)
    seq_lens = [1, 7, 15, 16, 17, 33, 40, 47, 64, 65, 90, 100]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for length in seq_lens:
        table = [free.pop() for _ in range(-(-length // block_size))]
        for pos in range(length):
            slot = (table[pos // block_size], pos % block_size)
            k_cache[slot] = torch.randn(kv_heads, head_dim, generator=gen).to(torch.bfloat16)
            v_cache[slot] = torch.randn(kv_heads, head_dim, generator=gen).to(torch.bfloat16)
        tables.append(table)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=gen).to(torch.bfloat16)
    crowd = _decode_attention(kernels, q, k_cache, v_cache, tables, seq_lens)
    assert torch.isfinite(crowd.float()).all()
    expected = _reference_attention(
        q.float(), k_cache.float(), v_cache.float(), tables, seq_lens, [1] * len(seq_lens),
        head_dim**-0.5,
    )  # fmt: skip
    torch.testing.assert_close(crowd.float(), expected, **BF16_ATTENTION_TOL)
    for i, length in enumerate(seq_lens):
        alone = _decode_attention(kernels, q[i : i + 1], k_cache, v_cache, [tables[i]], [length])
        assert same_bits(alone, crowd[i : i + 1]), length


def test_paged_attention_selected_sequences_only(kernels):
    """Sequences not in seq_ids are left untouched (another path computes them)."""
    k_cache = torch.randn(4, 16, 1, 8)
    v_cache = torch.randn(4, 16, 1, 8)
    q = torch.randn(3, 2, 8)
    out = torch.zeros(3, 2, 8)
    kernels.paged_attention(
        out,
        q,
        k_cache,
        v_cache,
        torch.tensor([[1], [2], [3]], dtype=torch.int32),
        torch.tensor([5, 9, 3], dtype=torch.int32),
        torch.tensor([0, 1, 2, 3], dtype=torch.int32),
        torch.tensor([0, 2], dtype=torch.int32),
        1,
        0.3,
    )
    assert out[0].abs().sum() > 0 and out[2].abs().sum() > 0
    assert torch.equal(out[1], torch.zeros(2, 8))


def test_paged_attention_refuses_block_ids_outside_the_cache(kernels):
    out = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="block id outside 0..3"):
        kernels.paged_attention(
            out,
            torch.randn(1, 2, 8),
            torch.randn(4, 16, 1, 8),
            torch.randn(4, 16, 1, 8),
            torch.tensor([[1, 7]], dtype=torch.int32),
            torch.tensor([20], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32),
            1,
            0.3,
        )


@pytest.mark.parametrize(
    ("seq_lens", "seq_ids", "table"),
    [
        ([40], [0], [[1, 2]]),  # 40 tokens need 3 blocks: the table row has 2
        ([20], [1], [[1, 2]]),  # sequence 1 does not exist
    ],
)
def test_paged_attention_refuses_metadata_that_does_not_fit(kernels, seq_lens, seq_ids, table):
    with pytest.raises(ValueError, match="do not fit the block table"):
        kernels.paged_attention(
            torch.zeros(1, 2, 8),
            torch.randn(1, 2, 8),
            torch.randn(4, 16, 1, 8),
            torch.randn(4, 16, 1, 8),
            torch.tensor(table, dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor(seq_ids, dtype=torch.int32),
            1,
            0.3,
        )


def test_paged_attention_refuses_mixed_dtypes(kernels):
    with pytest.raises(ValueError, match="out is torch.float32 but query is torch.bfloat16"):
        kernels.paged_attention(
            torch.zeros(1, 2, 8),
            torch.randn(1, 2, 8, dtype=torch.bfloat16),
            torch.randn(4, 16, 1, 8),
            torch.randn(4, 16, 1, 8),
            torch.tensor([[1]], dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32),
            1,
            0.3,
        )


@pytest.mark.parametrize("rows", [3, 100])  # below and above the threading cut-off
def test_rms_norm_and_fused_residual(kernels, rows):
    x = torch.randn(rows, 96) * 3
    residual = torch.randn(rows, 96)
    weight = torch.randn(96)
    torch.testing.assert_close(
        kernels.rms_norm(x, weight, 1e-5), F.rms_norm(x, (96,), weight, 1e-5)
    )
    expected_residual = x + residual
    expected = F.rms_norm(expected_residual, (96,), weight, 1e-5)
    out = kernels.rms_norm(x, weight, 1e-5, residual=residual)
    torch.testing.assert_close(residual, expected_residual)  # updated in place
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("rows", [3, 32, 100, 2000])  # 32 x 576: threaded by values
def test_rms_norm_bf16_rounds_like_the_torch_path(kernels, rows):
    gen = torch.Generator().manual_seed(rows)
    bf16 = torch.bfloat16
    x = (torch.randn(rows, 576, generator=gen) * 3).to(bf16)
    residual = torch.randn(rows, 576, generator=gen).to(bf16)
    weight = torch.randn(576, generator=gen).to(bf16)
    assert_bf16_close(kernels.rms_norm(x, weight, 1e-5), _torch_rms_norm(x, weight, 1e-5), 2, 1e-3)
    expected_residual = x + residual  # rounded to bf16 once, as the kernel does
    out = kernels.rms_norm(x, weight, 1e-5, residual=residual)
    assert same_bits(residual, expected_residual)
    assert_bf16_close(out, _torch_rms_norm(expected_residual, weight, 1e-5), 2, 1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_q_and_k_heads_in_place(kernels, dtype):
    heads, kv_heads, head_dim, n = 4, 2, 16, 70
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim).to(dtype)
    positions = torch.randint(0, 50, (n,))
    angles = torch.arange(64)[:, None] * torch.rand(head_dim // 2)[None, :]
    cos_sin = torch.stack([angles.cos(), angles.sin()], dim=1).to(dtype)  # [64, 2, hd/2]
    qk = qkv[:, : (heads + kv_heads) * head_dim].reshape(n, heads + kv_heads, head_dim)
    cs = cos_sin[positions]
    expected = apply_rope(qk, cs[:, 0:1], cs[:, 1:2])
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    kernels.rope(qkv, positions, cos_sin, heads + kv_heads)
    rotated = qkv[:, : (heads + kv_heads) * head_dim].view(n, heads + kv_heads, head_dim)
    if dtype == torch.float32:
        torch.testing.assert_close(rotated, expected)
    else:  # torch rounds each product and each sum to bf16; so does the kernel
        assert same_bits(rotated, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)
    with pytest.raises(ValueError, match="outside the rotary table"):
        kernels.rope(qkv, torch.full((n,), 64), cos_sin, heads + kv_heads)


@pytest.mark.parametrize("dtypes", KV_DTYPES)
def test_write_kv_skips_padding_and_refuses_out_of_range_slots(kernels, dtypes):
    dtype, kv_dtype = dtypes
    k_cache = torch.zeros(3, 4, 2, 8, dtype=kv_dtype)
    v_cache = torch.zeros(3, 4, 2, 8, dtype=kv_dtype)
    fused = torch.randn(3, 48).to(dtype)
    key = fused[:, 16:32].view(3, 2, 8)
    value = fused[:, 32:48].view(3, 2, 8)
    kernels.write_kv(key, value, k_cache, v_cache, torch.tensor([5, -1, 11]))
    flat_k, flat_v = k_cache.view(12, 2, 8), v_cache.view(12, 2, 8)
    # into a bf16 cache rounded as torch rounds (nearest, ties to even)
    assert torch.equal(flat_k[5], key[0].to(kv_dtype))
    assert torch.equal(flat_v[11], value[2].to(kv_dtype))
    assert int((flat_k.abs().sum((1, 2)) > 0).sum()) == 2  # the -1 slot wrote nothing
    with pytest.raises(ValueError, match="past the cache's 12 slots"):
        kernels.write_kv(key, value, k_cache, v_cache, torch.tensor([0, 1, 12]))


def test_write_kv_into_a_bf16_cache_rounds_every_float_as_torch_does(kernels):
    """fp32 K/V into a bf16 cache (--kv-cache-dtype bfloat16): ties, the largest finite
    values, subnormals, infinities and NaNs (whose bits rounding would carry into the
    sign or the exponent) come out as torch's .to(torch.bfloat16) makes them."""
    specials = torch.tensor(
        [1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.3895314e38, -3.4028235e38, 1e-40,
         float("inf"), float("-inf"), 0.0, -0.0],
    )  # fmt: skip
    bits = torch.tensor([0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0x7FC00000], dtype=torch.int64)
    nans = bits.to(torch.int32).view(torch.float32)  # largest-mantissa, signed, signalling
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(64 * 16 - specials.numel() - nans.numel(), generator=gen) * 100
    values = torch.cat([specials, nans, rows]).view(64, 2, 8)
    k_cache = torch.zeros(16, 4, 2, 8, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    kernels.write_kv(values, -values, k_cache, v_cache, torch.arange(64))
    k, v = k_cache.view(64, 2, 8), v_cache.view(64, 2, 8)
    finite = ~values.isnan()
    assert torch.equal(
        k[finite].view(torch.int16), values[finite].to(torch.bfloat16).view(torch.int16)
    )
    assert torch.equal(v[finite], (-values[finite]).to(torch.bfloat16))
    assert k[~finite].isnan().all() and v[~finite].isnan().all()
    # a NaN keeps its sign
    assert torch.equal(k[~finite].view(torch.int16) < 0, values[~finite].view(torch.int32) < 0)


def test_bf16_cache_takes_float32_rows_only(kernels):
    """A bf16 cache under float32 rows is --kv-cache-dtype bfloat16; any other mix of
    dtypes is refused, naming the arguments."""
    key = torch.randn(1, 1, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k_cache is torch.float32 but key is torch.bfloat16"):
        kernels.write_kv(key, key, torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8),
                         torch.tensor([0]))  # fmt: skip
    with pytest.raises(ValueError, match="v_cache is torch.float32 but k_cache is torch.bfloat16"):
        kernels.write_kv(key.float(), key.float(), torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16),
                         torch.zeros(2, 4, 1, 8), torch.tensor([0]))  # fmt: skip


@pytest.mark.parametrize("rows", [2, 80])
def test_silu_and_mul(kernels, rows):
    x = torch.randn(rows, 2 * 40) * 4
    x[0, 0], x[0, 1] = -200.0, 200.0  # exp overflow on both sides stays finite
    gate, up = x.split(40, dim=1)
    out = kernels.silu_and_mul(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.silu(gate) * up)


# serial; threaded by rows (>= 64); threaded by values (a 32-request decode step's MLP)
@pytest.mark.parametrize(("rows", "inter"), [(2, 40), (80, 40), (32, 600)])
def test_silu_and_mul_bf16_is_torchs(kernels, rows, inter):
    x = (torch.randn(rows, 2 * inter) * 4).to(torch.bfloat16)
    gate, up = x.split(inter, dim=1)
    assert same_bits(kernels.silu_and_mul(x), F.silu(gate) * up)


def test_silu_bf16_is_torchs_for_every_input(kernels):
    """Every finite bfloat16 gate from -80 up (below, exp(-gate) is clamped: the result
    is a tiny negative number where torch's is -0 or subnormal)."""
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = gate[torch.isfinite(gate) & (gate >= -80)]
    x = torch.stack([gate, torch.ones_like(gate)], dim=1)  # up = 1: silu alone
    assert same_bits(kernels.silu_and_mul(x)[:, 0].contiguous(), F.silu(gate))


def test_build_failure_is_one_line_and_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "definitely-not-a-compiler")
    monkeypatch.setattr(build_mod.shutil, "which", lambda name: None)
    with pytest.raises(KernelBuildError, match="no C compiler found"):
        build_library(tmp_path)
    cpu_kernels.cache_clear()
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    try:
        assert cpu_kernels() is None
        assert "CPU kernels unavailable" in caplog.text
    finally:
        cpu_kernels.cache_clear()


def test_switched_off_by_environment(monkeypatch):
    cpu_kernels.cache_clear()
    monkeypatch.setenv("SPECSERVE_CPU_KERNELS", "0")
    try:
        assert cpu_kernels() is None
    finally:
        cpu_kernels.cache_clear()


def test_switch_restores_the_environment(monkeypatch):
    monkeypatch.setenv("SPECSERVE_CPU_KERNELS", "1")
    with cpu_mod.cpu_kernels_enabled(False):
        assert cpu_kernels() is None and os.environ["SPECSERVE_CPU_KERNELS"] == "0"
    assert os.environ["SPECSERVE_CPU_KERNELS"] == "1" and cpu_kernels() is not None
    monkeypatch.delenv("SPECSERVE_CPU_KERNELS")
    with cpu_mod.cpu_kernels_enabled(False):
        pass
    assert "SPECSERVE_CPU_KERNELS" not in os.environ


@pytest.mark.usefixtures("compile_once")
def test_build_is_cached_per_source(tmp_path):
    first = build_library(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert build_library(tmp_path) == first and first.stat().st_mtime_ns == mtime


def test_build_source_builds_the_source_it_is_given(kernels):
    """scripts/bench_kernel_ab.py builds another revision's kernels this way: the
    working tree's source gives the kernels' own outputs; a source that does not compile
    is one line naming the error, not a fallback."""
    built = CpuKernels(build_mod.build_source(build_mod.read_source()))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(built.silu_and_mul(x), kernels.silu_and_mul(x))
    with pytest.raises(KernelBuildError, match=r"failed to build the CPU kernels: .*error") as e:
        build_mod.build_source(b"int broken = ;\n")
    assert "\n" not in str(e.value)


def test_loading_the_kernels_leaves_subnormals_alone(kernels):
    """-ffast-math at link time would set flush-to-zero for the whole process."""
    tiny = torch.tensor([1e-40], dtype=torch.float32)  # subnormal in fp32
    assert kernels.lib is not None  # loaded in this process
    assert (tiny * 1.0).item() != 0.0  # 0.0 under flush-to-zero / denormals-are-zero


@pytest.mark.usefixtures("compile_once")
def test_read_only_cache_falls_back_to_a_private_build(tmp_path, monkeypatch):
    """A baked read-only cache with no build for this CPU: a build for this process,
    loaded through its descriptor, and nothing left behind in either directory."""
    read_only = tmp_path / "baked"
    read_only.mkdir()
    read_only.chmod(0o555)
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(build_mod.tempfile, "tempdir", str(temp))
    try:
        if os.access(read_only, os.W_OK):  # root ignores permission bits
            real_access = os.access
            monkeypatch.setattr(
                build_mod.os,
                "access",
                lambda path, mode: path != read_only and real_access(path, mode),
            )
        built = build_library(read_only)
    finally:
        read_only.chmod(0o755)
    assert built.parent == Path("/proc/self/fd") and built.exists()
    assert not any(read_only.iterdir()) and not any(temp.iterdir())
    x = torch.randn(3, 8)
    gate, up = x.split(4, dim=1)
    torch.testing.assert_close(CpuKernels(built).silu_and_mul(x), F.silu(gate) * up)


def test_kernel_source_ships_as_package_data():
    import tomllib

    root = Path(__file__).resolve().parents[2]
    config = tomllib.loads((root / "pyproject.toml").read_text())
    assert "*.c" in config["tool"]["setuptools"]["package-data"]["engine.kernels"]


def test_compiler_failure_is_one_line(monkeypatch, tmp_path):
    bad_cc = tmp_path / "cc"
    bad_cc.write_text(
        "#!/bin/sh\necho 'note: something' >&2\necho 'x.c:1: error: broken' >&2\nexit 1\n"
    )
    bad_cc.chmod(0o755)
    monkeypatch.setenv("CC", str(bad_cc))
    with pytest.raises(KernelBuildError, match=r"failed to build the CPU kernels: x.c:1: error"):
        build_library(tmp_path / "out")


@pytest.mark.parametrize("dtypes", KV_DTYPES)
def test_paged_attention_rows_do_not_depend_on_the_chunking(kernels, dtypes):
    """A 100-token prompt's attention in one call (four query tiles) and as chunks of
    37, 1 and 62 tokens (other tiles, other work items): every row bit-identical. bf16
    greedy output with and without speculation rests on this."""
    dtype, kv_dtype = dtypes
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, block_size, seq_len = 6, 3, 32, 16, 100
    k_cache = torch.randn(16, block_size, kv_heads, head_dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(16, block_size, kv_heads, head_dim, generator=gen).to(kv_dtype)
    table = torch.tensor([[9, 3, 14, 1, 7, 12, 5]], dtype=torch.int32)
    q = torch.randn(seq_len, heads, head_dim, generator=gen).to(dtype)

    def attend(start: int, end: int) -> torch.Tensor:
        out = torch.empty(end - start, heads, head_dim, dtype=dtype)
        kernels.paged_attention(
            out, q[start:end], k_cache, v_cache, table,
            torch.tensor([end], dtype=torch.int32),
            torch.tensor([0, end - start], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32), end - start, head_dim**-0.5,
        )  # fmt: skip
        return out

    whole = attend(0, seq_len)
    pieces = torch.cat([attend(0, 37), attend(37, 38), attend(38, seq_len)])
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(whole.view(bits), pieces.view(bits))


def _scattered_sequences(gen, seq_lens, q_lens, heads, kv_heads, head_dim, dtype, kv_dtype,
                         block_size=16):  # fmt: skip
    """Random queries and a random cache for sequences of seq_lens tokens adding q_lens
    each, their blocks scattered: (q, k_cache, v_cache, table, starts, lens, per), per
    the blocks of each sequence."""
    per = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per) + 1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(*shape, generator=gen).to(kv_dtype)
    v_cache = torch.randn(*shape, generator=gen).to(kv_dtype)
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1
    table = torch.zeros(len(seq_lens), max(per), dtype=torch.int32)
    for i, n in enumerate(per):
        table[i, :n] = ids[sum(per[:i]) : sum(per[: i + 1])]
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return q, k_cache, v_cache, table, starts, lens, per


@pytest.mark.parametrize("dtypes", KV_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 24, 13])  # 64: bf16's vdpbf16ps rows where built
def test_paged_attention_rows_do_not_depend_on_threads_or_the_batch(kernels, dtypes, head_dim):
    """Keys are folded in chunks of 8 cache blocks, merged in order; a call of few work
    items (a lone decode on 2+ threads) spreads one sequence's chunks over the threads.
    Each sequence alone on 2, 3 and 4 threads (split across them), and all of them in
    one call on 2, 3 and 4 threads (each thread taking its next item ahead and asking
    for its first blocks), against all of them in one call on one thread (never split):
    every row bit-identical, and close to the reference. Contexts at and past the chunk
    edges, a verification query and a prompt chunk."""
    dtype, kv_dtype = dtypes
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads = 9, 3
    seq_lens = [300, 129, 128, 17, 1000, 200, 300]
    q_lens = [1, 1, 1, 1, 1, 5, 40]
    q, k_cache, v_cache, table, starts, lens, per = _scattered_sequences(
        gen, seq_lens, q_lens, heads, kv_heads, head_dim, dtype, kv_dtype
    )
    scale = head_dim**-0.5
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        crowd = torch.full_like(q, float("nan"))
        kernels.paged_attention(crowd, q, k_cache, v_cache, table, lens, starts,
                                torch.arange(len(seq_lens), dtype=torch.int32), max(q_lens),
                                scale)  # fmt: skip
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        for n in (2, 3, 4):
            torch.set_num_threads(n)
            many = torch.full_like(q, float("nan"))
            kernels.paged_attention(many, q, k_cache, v_cache, table, lens, starts,
                                    torch.arange(len(seq_lens), dtype=torch.int32),
                                    max(q_lens), scale)  # fmt: skip
            assert torch.equal(many.view(bits), crowd.view(bits)), n
            for i in range(len(seq_lens)):
                alone = torch.full_like(q, float("nan"))
                kernels.paged_attention(alone, q, k_cache, v_cache, table, lens, starts,
                                        torch.tensor([i], dtype=torch.int32), q_lens[i],
                                        scale)  # fmt: skip
                rows = slice(int(starts[i]), int(starts[i + 1]))
                assert torch.equal(alone[rows].view(bits), crowd[rows].view(bits)), (
                    n, seq_lens[i], q_lens[i],
                )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    expected = _reference_attention(q.float(), k_cache.float(), v_cache.float(),
                                    [t[:n].tolist() for t, n in zip(table, per, strict=True)],
                                    seq_lens, q_lens, scale)  # fmt: skip
    if dtype == torch.float32:
        torch.testing.assert_close(crowd, expected, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(crowd.float(), expected, **BF16_ATTENTION_TOL)


@pytest.mark.parametrize("dtypes", KV_DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 4, 128), (6, 2, 13)])
def test_items_of_every_kv_head_give_the_bits_of_items_of_one(kernels, dtypes, heads, kv_heads,
                                                              head_dim):  # fmt: skip
    """Off the vdpbf16ps path, attention makes a work item of all a tile's KV heads at
    once (each cache block read front to back) when every tile has at most 8 query tokens
    and there is a unit of work for each thread; else one KV head an item. The rows must
    not tell: decodes and a verification query in one call on one thread (items of all
    heads) against the same call with a 40-token prompt added (a 32-token tile: items of
    one head), and each sequence alone on 2 threads (its key chunks split, all heads while
    it has 2 chunks or more) and on 4 (one head an item below 4 chunks). Every row
    bit-identical; close to the reference."""
    dtype, kv_dtype = dtypes
    gen = torch.Generator().manual_seed(23)
    seq_lens = [300, 129, 17, 1000, 200, 60, 400]
    q_lens = [1, 1, 1, 1, 5, 8, 40]
    q, k_cache, v_cache, table, starts, lens, per = _scattered_sequences(
        gen, seq_lens, q_lens, heads, kv_heads, head_dim, dtype, kv_dtype
    )
    scale = head_dim**-0.5
    small = len(seq_lens) - 1  # the sequences of at most 8 query tokens

    def run(selected: list[int], threads: int) -> torch.Tensor:
        torch.set_num_threads(threads)
        out = torch.full_like(q, float("nan"))
        kernels.paged_attention(out, q, k_cache, v_cache, table, lens, starts,
                                torch.tensor(selected, dtype=torch.int32),
                                max(q_lens[i] for i in selected), scale)  # fmt: skip
        return out

    threads = torch.get_num_threads()
    try:
        all_heads = run(list(range(small)), 1)
        one_head = run(list(range(len(seq_lens))), 1)
        alone = {(i, n): run([i], n) for i in range(small) for n in (2, 4)}
    finally:
        torch.set_num_threads(threads)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for i in range(small):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        want = all_heads[rows].view(bits)
        assert torch.equal(one_head[rows].view(bits), want), (seq_lens[i], q_lens[i])
        for n in (2, 4):
            got = alone[i, n][rows].view(bits)
            assert torch.equal(got, want), (n, seq_lens[i], q_lens[i])
    expected = _reference_attention(q.float(), k_cache.float(), v_cache.float(),
                                    [t[:n].tolist() for t, n in zip(table, per, strict=True)],
                                    seq_lens, q_lens, scale)  # fmt: skip
    if dtype == torch.float32:
        torch.testing.assert_close(one_head, expected, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(one_head.float(), expected, **BF16_ATTENTION_TOL)


# --- bf16 Linear layers (vdpbf16ps on AVX512-BF16, widen + FMA with FMA, AMX tiles) ----


@pytest.fixture(scope="module", params=["vdpbf16ps", "fma", "amx"])
def linear_kernels(kernels, request) -> CpuKernels:
    """The native kernels with each bf16 Linear kernel in turn (put back after); for
    AMX on a CPU without it, the emulated AMX level's kernels (``amx_kernels``)."""
    flags = build_mod.cpu_flags()
    if request.param == "amx" and "amx" not in kernels.bf16_linear_modes:
        kernels = amx_kernels(request) or kernels
    if request.param not in kernels.bf16_linear_modes:
        if request.param == "vdpbf16ps" and {"avx512_bf16", "avx512f"} <= flags:
            pytest.fail("this CPU has AVX512-BF16 but the kernels were built without it")
        if request.param == "fma" and "fma" in flags:
            pytest.fail("this CPU has FMA but the kernels were built without it")
        if request.param == "amx" and {"amx_bf16", "amx_tile", "avx512f"} <= flags:
            if kernels.amx_tiles != 1:
                pytest.fail("this CPU has AMX-BF16 but the kernels were built without it")
            pytest.skip("this CPU has AMX-BF16 but Linux did not lend the tiles")
        pytest.skip(f"this CPU has no {request.param} bf16 Linear kernel")
    before = kernels.set_bf16_linear(request.param)
    yield kernels
    kernels.set_bf16_linear(before)


def _exact_linear(x, weight, bias) -> torch.Tensor:
    """fp64 x @ weight.T + bias of the bf16 inputs, unrounded."""
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def _assert_linear_close(out, x, weight, bias) -> None:
    """Half a bf16 ulp of the exact result (one rounding), plus fp32 sums: each of the
    k additions errs by at most 2^-24 of the running sum, bounded by sum |x * w|."""
    exact = _exact_linear(x, weight, bias)
    magnitude = x.double().abs() @ weight.double().abs().T
    bound = 2.0**-8 * exact.abs() + (x.shape[1] + 2) * 2.0**-23 * magnitude + 1e-30
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    assert bool(((out.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize(
    ("n", "k", "with_bias"),
    [(64, 64, False), (70, 37, True), (5, 2, True), (96, 1, False), (33, 600, True)],
)
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 40])
def test_linear_bf16_is_the_rounded_exact_product(linear_kernels, n, k, with_bias, rows):
    """Outputs past a 32-wide tile and odd k (padded with zeros) included."""
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    out = linear_kernels.linear(x, linear_kernels.pack_linear_weight(weight), bias, n)
    _assert_linear_close(out, x, weight, bias)


def test_linear_bf16_rows_do_not_depend_on_the_batch(linear_kernels):
    """A row alone, in every position of batches of 1 to 40 rows (so in every register
    block and at every offset in it), on 1 thread and on 2: the same bits. bf16 greedy
    output with and without speculation, and seeded output alone and in a crowd, rest
    on this."""
    gen = torch.Generator().manual_seed(5)
    n, k = 100, 96
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    packed = linear_kernels.pack_linear_weight(weight)
    check_linear_rows_do_not_depend_on_the_batch(linear_kernels, packed, bias, k, gen)


def test_amx_bf16_linear_runs_on_tiles_with_any_k(request):
    """The AMX kernel (this CPU's tiles, else emulated): inputs in groups of 32 and a
    tail group of fewer pairs (an odd k completed with 0), rows in tiles of 16 padded
    with zero rows: each call runs on the tiles (counted), is within the exact
    product's bound, and a row's bits are the same alone and in batches of 1 to 40
    (tail group included); against the FMA kernel, at most 1 output in 1000 differs."""
    kernels = amx_kernels(request)
    if kernels is None or "amx" not in kernels.bf16_linear_modes:
        pytest.skip("no AMX bf16 Linear kernel here, nor AVX512-BF16 to emulate it on")
    calls = kernels.lib.specserve_linear_amx_calls
    calls.restype, calls.argtypes = ctypes.c_int64, []
    before = kernels.set_bf16_linear("amx")
    try:
        gen = torch.Generator().manual_seed(12)
        for n, k in [(100, 37), (40, 70), (33, 600), (64, 32)]:
            weight = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
            bias = torch.randn(n, generator=gen).to(torch.bfloat16)
            packed = kernels.pack_linear_weight(weight)
            for rows in (1, 15, 16, 17, 33):
                x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
                ran = calls()
                out = kernels.linear(x, packed, bias, n)
                assert calls() == ran + 1
                _assert_linear_close(out, x, weight, bias)
        check_linear_rows_do_not_depend_on_the_batch(kernels, packed, bias, k, gen)
        weight = torch.randn(40, 70, generator=gen).to(torch.bfloat16)
        bias = torch.randn(40, generator=gen).to(torch.bfloat16)
        packed = kernels.pack_linear_weight(weight)
        check_linear_rows_do_not_depend_on_the_batch(kernels, packed, bias, 70, gen)
        # the tile unit's fp32 sums are not the FMA chain's, but the bf16 results rarely
        # differ (a wrong tile layout would differ everywhere), each within the bound
        weight = (torch.randn(1536, 576, generator=gen) / 24).to(torch.bfloat16)
        bias = torch.randn(1536, generator=gen).to(torch.bfloat16)
        x = torch.randn(32, 576, generator=gen).to(torch.bfloat16)
        packed = kernels.pack_linear_weight(weight)
        on_tiles = kernels.linear(x, packed, bias, 1536)
        kernels.set_bf16_linear("fma")
        on_fma = kernels.linear(x, packed, bias, 1536)
        assert int((on_tiles.view(torch.int16) != on_fma.view(torch.int16)).sum()) <= 49
        _assert_linear_close(on_tiles, x, weight, bias)
    finally:
        kernels.set_bf16_linear(before)


def check_linear_rows_do_not_depend_on_the_batch(kernels, packed, bias, k, gen) -> None:
    """``kernels.linear`` with ``packed`` (of [len(bias), k]): a row drawn from ``gen``
    gives the same bits alone and at a random place in batches of 1 to 40 rows, on 1
    thread and on 2."""
    n, dtype = bias.shape[0], bias.dtype
    row = torch.randn(1, k, generator=gen).to(dtype)
    alone = kernels.linear(row, packed, bias, n)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            for rows in range(1, 41):
                x = torch.randn(rows, k, generator=gen).to(dtype)
                at = int(torch.randint(rows, (1,), generator=gen))
                x[at] = row[0]
                out = kernels.linear(x, packed, bias, n)
                assert same_bits(out[at : at + 1], alone), (num_threads, rows, at)
    finally:
        torch.set_num_threads(threads)


def test_linear_bf16_takes_strided_rows(linear_kernels):
    """The attention output reaches o_proj as a view; rows far apart give what their
    dense copy gives, and nothing between them is read into the result."""
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(40, 24, generator=gen).to(torch.bfloat16)
    packed = linear_kernels.pack_linear_weight(weight)
    check_linear_takes_strided_rows(linear_kernels, packed, gen, torch.bfloat16)


def check_linear_takes_strided_rows(kernels, packed, gen, dtype) -> None:
    """``packed`` of a [40, 24] weight: x as columns 8..31 of wider rows drawn from
    ``gen`` gives its dense copy's bits, and NaN past those columns changes nothing."""
    wide = torch.randn(7, 64, generator=gen).to(dtype)
    x = wide[:, 8:32]
    assert not x.is_contiguous()
    out = kernels.linear(x, packed, None, 40)
    assert same_bits(out, kernels.linear(x.contiguous(), packed, None, 40))
    wide[:, 32:] = float("nan")
    assert same_bits(kernels.linear(x, packed, None, 40), out)


def test_linear_bf16_refuses_what_does_not_fit(linear_kernels):
    weight = torch.randn(40, 24).to(torch.bfloat16)
    packed = linear_kernels.pack_linear_weight(weight)
    x = torch.randn(3, 24).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"packed .* is not a packed \[65, 24\] weight"):
        linear_kernels.linear(x, packed, None, 65)  # 2 tiles of 32 packed, 3 needed
    with pytest.raises(ValueError, match=r"packed .* is not a packed \[40, 26\] weight"):
        linear_kernels.linear(torch.randn(3, 26).to(torch.bfloat16), packed, None, 40)
    with pytest.raises(ValueError, match="packed is torch.float32 but x is torch.bfloat16"):
        linear_kernels.linear(x, packed.float(), None, 40)
    with pytest.raises(ValueError, match=r"bias \[39\] != out_features 40"):
        linear_kernels.linear(x, packed, torch.zeros(39, dtype=torch.bfloat16), 40)
    with pytest.raises(ValueError, match="weight must be a 2-D float32 or bfloat16 CPU tensor"):
        linear_kernels.pack_linear_weight(weight.double())
    with pytest.raises(ValueError, match="x must be 2-D"):
        linear_kernels.linear(x[None], packed, None, 40)
    assert linear_kernels.linear(x[:0], packed, None, 40).shape == (0, 40)
