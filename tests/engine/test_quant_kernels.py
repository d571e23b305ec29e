"""The quantized Linear kernels (engine/kernels/quant_kernels.c) against a reference.

The reference quantizes each row's activations per 32-block as the kernel promises
(xd = max|x| / 127, xq = round-half-even(x / xd)) and multiplies them, dequantized,
by the dequantized weights (gguf's own dequantizer) in float64: the kernel's integer
dot products are exact, so they differ only by its fp32 accumulation. Rows are
bit-identical however they are batched, on one thread or two; bf16 is the fp32 result
rounded once; every misuse is a ValueError before C runs. The AMX-BF16 path that
``--no-batch-invariance`` turns on has its own reference (the bf16-rounded operands).
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.kernels.cpu import cpu_kernels
from engine.kernels.quant import BLOCK, FORMATS, QuantOps, quant_ops
from tests.engine.kernel_levels import amx_kernels, kernels_at_level, runnable_levels

FORMAT_NAMES = list(FORMATS)


@pytest.fixture(scope="module")
def ops() -> QuantOps:
    found = quant_ops()
    if found is None:
        pytest.fail("CPU kernels failed to build; see the warning logged by cpu_kernels()")
    return found


def quantize_rows(weight: torch.Tensor, name: str) -> torch.Tensor:
    """GGUF rows (uint8 [n, k / 32 * block bytes]) of ``weight`` [n, k]."""
    kind = getattr(gguf.GGMLQuantizationType, name)
    return torch.from_numpy(gguf.quants.quantize(weight.float().numpy(), kind))


def dequantize_rows(rows: torch.Tensor, name: str) -> torch.Tensor:
    kind = getattr(gguf.GGMLQuantizationType, name)
    return torch.from_numpy(gguf.quants.dequantize(rows.numpy(), kind))


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x [m, k] as the kernel sees it: xd * xq per 32-block, in float64."""
    blocks = x.double().reshape(x.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True).float()
    # 127 / amax rounded once, as the kernel divides: torch's `127.0 / amax` is
    # 127 * (1 / amax), rounded twice, which can be an ulp off and move a product that
    # the kernel rounds to exactly k + 0.5 (then to even) off that tie
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(blocks.float() * inv).clamp(-127, 127)
    return (xq.double() * (amax / 127.0).double()).reshape(x.shape)


def reference(x, rows, name, bias=None) -> torch.Tensor:
    out = quantized_activations(x) @ dequantize_rows(rows, name).double().T
    return out if bias is None else out + bias.double()


def _case(n: int, k: int, m: int, name: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g)
    x[0, :BLOCK] = 0.0  # an all-zero block: scale 0, nothing divided by it
    return weight, x, quantize_rows(weight, name)


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize(("n", "k", "m"), [(40, 96, 5), (16, 32, 1), (259, 64, 13), (7, 128, 9)])
def test_linear_matches_the_reference(ops, name, n, k, m):
    weight, x, rows = _case(n, k, m, name)
    fmt = FORMATS[name]
    bias = torch.randn(n)
    out = ops.linear(x, ops.pack(fmt, rows, k), bias)
    ref = reference(x, rows, name, bias)
    scale = (quantized_activations(x).abs() @ dequantize_rows(rows, name).double().abs().T) + 1
    assert ((out.double() - ref).abs() / scale).max() < 1e-5


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_the_error_against_the_float_weights_is_the_quantization(ops, name):
    """Against x @ W.T in float: the weights' and activations' rounding, nothing else."""
    weight, x, rows = _case(64, 256, 8, name)
    fmt = FORMATS[name]
    out = ops.linear(x, ops.pack(fmt, rows, 256), None)
    exact = x @ weight.T
    rel = (out - exact).norm() / exact.norm()
    assert rel < (0.02 if name == "Q8_0" else 0.12), rel


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("n", [50, 40])
def test_rows_are_bit_identical_in_any_batch_and_thread_count(ops, name, n):
    """A row alone, in a call of many rows and in parts of one: the same bits, with the
    AVX-512 build's tiles read one after the other (calls of up to 6 rows, a call's last
    partial pass) or side by side (its full passes); n = 40 is three tiles of 16, so the
    last group's second tile lies past n."""
    weight, x, rows = _case(n, 160, 23, name, seed=3)
    fmt = FORMATS[name]
    packed = ops.pack(fmt, rows, 160)
    alone = torch.cat([ops.linear(x[i : i + 1], packed, None) for i in range(23)])
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            whole = ops.linear(x, packed, None)
            assert torch.equal(whole, alone), num_threads
            for start, stop in ((3, 11), (10, 23), (0, 9)):
                part = ops.linear(x[start:stop], packed, None)
                assert torch.equal(part, alone[start:stop]), (num_threads, start, stop)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tile_kernels(request):
    """Kernels whose AMX paths run (this CPU's tiles, else the emulated AMX level:
    ``kernel_levels.amx_kernels``); where neither, the native build, on which the tests
    of those paths check that their rules are inert."""
    found = amx_kernels(request)
    return found if found is not None else cpu_kernels()


@pytest.fixture(scope="module")
def tile_ops(tile_kernels) -> QuantOps:
    return QuantOps(tile_kernels.lib)


def _runs_amx(kernels, ops) -> bool:
    """The kernels' word: built with the AMX path (on zmm) and the tiles lent."""
    return kernels.amx_tiles == 2 and ops.path == "avx512-vnni"


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [32, 64, 192, 224])
def test_the_amx_path_gives_the_same_bits_as_vpdpbusd(tile_kernels, tile_ops, name, dtype, k):
    """Where the build has the AMX path (a CPU with AMX-INT8, or the emulated AMX
    level; elsewhere this checks the rule is inert): every output of every row is bit
    for bit what the vpdpbusd path gives, whichever rows take the tiles (chunks of 64
    rows, 16-row blocks inside them, a short last chunk on either path; one, two, an
    even and an odd number of 32-input blocks, which the tile pipeline takes in turns),
    so the row count a call has changes nothing (batch invariance)."""
    ops = tile_ops
    weight, x, rows = _case(83, k, 131, name, seed=5)
    x = x.to(dtype)
    packed = ops.pack(FORMATS[name], rows, k)
    bias = torch.randn(83).to(dtype)
    rule = ops.amx_min_rows
    try:
        ops.set_amx_min_rows(0)
        rows_per_call = (1, 5, 16, 17, 33, 40, 64, 65, 80, 131)
        plain = {m: ops.linear(x[:m], packed, bias) for m in rows_per_call}
        before = ops.amx_calls
        for amx_rule in (1, 5, 16, 20, -1):
            ops.set_amx_min_rows(amx_rule)
            for m, want in plain.items():
                assert torch.equal(ops.linear(x[:m], packed, bias), want), (amx_rule, m)
        ran = ops.amx_calls - before
    finally:
        ops.set_amx_min_rows(rule)
    if _runs_amx(tile_kernels, ops) and rule != 0:
        assert ran > 0, "kernels with AMX ran no call on their tiles"
    assert (ran > 0) <= _runs_amx(tile_kernels, ops)


@pytest.mark.parametrize(("name", "first"), [("Q8_0", 9), ("Q4_1", 128), ("Q4_0", 128)])
def test_the_amx_rule_by_format(tile_kernels, tile_ops, name, first):
    """-1 (as shipped): Q8_0 calls from 9 rows on the tiles, Q4 from 128 (prompts; a
    decode step of 32 sequences gains nothing there); a call one row short stays on
    vpdpbusd. The bits are vpdpbusd's either way."""
    ops = tile_ops
    if not (_runs_amx(tile_kernels, ops) and ops.amx_min_rows != 0):
        pytest.skip("no AMX-INT8 path here, nor AVX512-BF16 to emulate it: the rule is inert")
    _, x, rows = _case(40, 64, first, name, seed=3)
    packed = ops.pack(FORMATS[name], rows, 64)
    rule = ops.amx_min_rows
    try:
        ops.set_amx_min_rows(0)
        plain = {m: ops.linear(x[:m], packed, None) for m in (first - 1, first)}
        ops.set_amx_min_rows(-1)
        for m, tiles in ((first - 1, False), (first, True)):
            before = ops.amx_calls
            assert torch.equal(ops.linear(x[:m], packed, None), plain[m]), m
            assert (ops.amx_calls > before) == tiles, (name, m)
    finally:
        ops.set_amx_min_rows(rule)


def _cpu_has_amx_bf16() -> bool:
    from engine.kernels import build

    return {"amx_bf16", "amx_int8", "amx_tile"} <= build.cpu_flags()


@pytest.fixture()
def bf16_rule(tile_ops):
    """Sets the bf16-tile rule of ``tile_ops`` for a test, then puts it back."""
    before = tile_ops.bf16_min_rows
    yield tile_ops.set_bf16_min_rows
    tile_ops.set_bf16_min_rows(before)


def test_the_kernels_say_whether_they_run_bf16_tiles(ops):
    """``QuantOps.bf16_tiles``, which the tests and benchmarks of the path read, is the
    CPU's word: on a CPU with AMX-BF16 whose kernel level has the AMX path and whose
    tiles Linux lends, the library runs the path; elsewhere it says it does not."""
    from engine.kernels.cpu import cpu_kernels

    here = _cpu_has_amx_bf16() and ops.path == "avx512-vnni" and cpu_kernels().amx_tiles == 2
    assert ops.bf16_tiles == here


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize(("n", "k"), [(83, 96), (40, 32), (16, 224)])
def test_the_bf16_tile_path_is_x_times_the_bf16_weights(tile_ops, bf16_rule, name, n, k):
    """The not batch invariant path (``--no-batch-invariance``): x rounded to bf16
    times each weight dequantized (d * q (+ m) in fp32) and rounded to bf16, summed in
    fp32: within fp32 rounding of that float64 product, for every row of calls of 1 to
    131 rows (tails of 1-15 rows past the 16-row tiles, and outputs past the 32-output
    groups); the bf16 result is its fp32 result rounded once; and it ran on the tiles
    where the CPU has AMX-BF16 (elsewhere the rule is inert and the int8 paths run)."""
    ops = tile_ops
    weight, x, rows = _case(n, k, 131, name, seed=7)
    packed = ops.pack(FORMATS[name], rows, k)
    bias = torch.randn(n).bfloat16().float()
    w16 = dequantize_rows(rows, name).bfloat16().double()
    x16 = x.bfloat16().double()
    scale = x16.abs() @ w16.abs().T + 1
    bf16_rule(1)
    before = ops.bf16_calls
    for m in (1, 15, 16, 17, 32, 33, 64, 131):
        out = ops.linear(x[:m], packed, bias)
        if ops.bf16_tiles:
            ref = x16[:m] @ w16.T + bias.double()
            assert ((out.double() - ref).abs() / scale[:m]).max() < 2e-6, m
        out16 = ops.linear(x[:m].bfloat16(), packed, bias.bfloat16())
        # On the tiles x is rounded to bf16 either way; elsewhere the int8 paths quantize
        # the input as given, so the bf16 call is the fp32 call of x's bf16 values.
        same = out if ops.bf16_tiles else ops.linear(x[:m].bfloat16().float(), packed, bias)
        assert torch.equal(out16, same.bfloat16()), m
    ran = ops.bf16_calls - before
    assert (ran > 0) == ops.bf16_tiles, ran


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_bf16_tile_rows_are_bit_identical_in_any_batch_and_thread_count(tile_ops, bf16_rule, name):
    """Within the path (every call on it: rule 1) a row's outputs do not depend on the
    rows beside it, its 16-row tile or the thread: batch invariant again."""
    ops = tile_ops
    _, x, rows = _case(70, 160, 40, name, seed=9)
    packed = ops.pack(FORMATS[name], rows, 160)
    bf16_rule(1)
    alone = torch.cat([ops.linear(x[i : i + 1], packed, None) for i in range(40)])
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            assert torch.equal(ops.linear(x, packed, None), alone), num_threads
            for start, stop in ((3, 20), (17, 40), (0, 33)):
                part = ops.linear(x[start:stop], packed, None)
                assert torch.equal(part, alone[start:stop]), (num_threads, start, stop)
    finally:
        torch.set_num_threads(threads)


def test_the_bf16_tile_rule_by_format(tile_ops, bf16_rule):
    """-1 (what --no-batch-invariance sets): Q4 calls from 16 rows on the tiles, Q8_0
    from 32, smaller calls on the int8 paths (their bits); 0 (the default): never."""
    ops = tile_ops
    if not ops.bf16_tiles:
        pytest.skip("no AMX-BF16 here: the rule is inert (checked above)")
    for name, first in (("Q4_1", 16), ("Q4_0", 16), ("Q8_0", 32)):
        _, x, rows = _case(48, 64, first, name, seed=2)
        packed = ops.pack(FORMATS[name], rows, 64)
        bf16_rule(0)
        int8 = {m: ops.linear(x[:m], packed, None) for m in (first - 1, first)}
        bf16_rule(-1)
        before = ops.bf16_calls
        assert torch.equal(ops.linear(x[: first - 1], packed, None), int8[first - 1])
        assert ops.bf16_calls == before, name
        assert not torch.equal(ops.linear(x[:first], packed, None), int8[first]), name
        assert ops.bf16_calls > before, name


def test_a_nan_row_on_bf16_tiles_leaves_the_others_alone(tile_ops, bf16_rule):
    ops = tile_ops
    _, x, rows = _case(40, 96, 20, "Q4_1", seed=11)
    packed = ops.pack(FORMATS["Q4_1"], rows, 96)
    bf16_rule(1)
    clean = ops.linear(x, packed, None)
    x[7, 50] = float("nan")
    x[12, 3] = float("inf")
    out = ops.linear(x, packed, None)
    others = [i for i in range(20) if i not in (7, 12)]
    assert torch.equal(out[others], clean[others])
    if ops.bf16_tiles:
        assert out[7].isnan().all() and not out[12].isfinite().any()


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_bf16_is_the_fp32_result_rounded_once(ops, name):
    weight, x, rows = _case(48, 96, 6, name, seed=4)
    fmt = FORMATS[name]
    packed = ops.pack(fmt, rows, 96)
    xb = x.bfloat16()
    bias = torch.randn(48).bfloat16()
    out = ops.linear(xb, packed, bias)
    assert out.dtype is torch.bfloat16
    fp32 = ops.linear(xb.float(), packed, bias.float())
    assert torch.equal(out, fp32.bfloat16())


def test_strided_rows_read_the_rows_only(ops):
    weight, x, rows = _case(32, 64, 4, "Q4_1")
    fmt = FORMATS["Q4_1"]
    packed = ops.pack(fmt, rows, 64)
    wide = torch.full((4, 100), float("nan"))
    wide[:, 10:74] = x
    assert torch.equal(ops.linear(wide[:, 10:74], packed, None), ops.linear(x, packed, None))


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows_are_the_dequantized_weights(ops, name, dtype):
    weight, _, rows = _case(37, 64, 1, name)
    fmt = FORMATS[name]
    packed = ops.pack(fmt, rows, 64)
    ids = torch.tensor([36, 0, 5, 5, 17])
    out = ops.embed(ids, packed, dtype)
    assert torch.equal(out, dequantize_rows(rows, name)[ids].to(dtype))


def test_an_empty_batch_gives_an_empty_result(ops):
    _, x, rows = _case(16, 32, 1, "Q8_0")
    packed = ops.pack(8, rows, 32)
    assert ops.linear(x[:0], packed, None).shape == (0, 16)
    empty = torch.zeros(0, dtype=torch.int64)
    assert ops.embed(empty, packed, torch.float32).shape == (0, 32)


# ---- misuse: a ValueError naming the argument, before C runs -----------------------------


def _valid(ops):
    _, x, rows = _case(20, 64, 3, "Q4_0")
    return x, ops.pack(2, rows, 64)


def _with(weight, **changes):
    return dataclasses.replace(weight, **changes)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (lambda x, w: dict(x=x.double()), "x must be a float32 or bfloat16"),
        (lambda x, w: dict(x=x[:, :32]), "does not fit a"),
        (lambda x, w: dict(weight=_with(w, data=w.data[:-1])), "packed holds"),
        (lambda x, w: dict(weight=_with(w, data=w.data.view(torch.int8))), "dense uint8"),
        (lambda x, w: dict(weight=_with(w, data=w.data[::2])), "dense uint8"),
        (lambda x, w: dict(weight=_with(w, fmt=5)), "unknown quantized format"),
        (lambda x, w: dict(weight=_with(w, fmt=3)), "packed holds"),  # Q4_1 is larger
        (lambda x, w: dict(weight=_with(w, n=40)), "packed holds"),
        (lambda x, w: dict(weight=_with(w, k=60), x=x[:, :60]), "multiple of 32"),
        (lambda x, w: dict(bias=torch.zeros(19)), "bias"),
        (lambda x, w: dict(bias=torch.zeros(20).bfloat16()), "bias is"),
        (lambda x, w: dict(x=x.unsqueeze(0)), "2-D"),
    ],
)
def test_linear_refuses(ops, case, message):
    x, weight = _valid(ops)
    args = dict(x=x, weight=weight, bias=None)
    args.update(case(x, weight))
    with pytest.raises(ValueError, match=message):
        ops.linear(**args)


def test_embed_and_pack_refuse(ops):
    x, packed = _valid(ops)
    with pytest.raises(ValueError, match="outside 0..19"):
        ops.embed(torch.tensor([0, 20]), packed, torch.float32)
    with pytest.raises(ValueError, match="outside 0..19"):
        ops.embed(torch.tensor([-1]), packed, torch.float32)
    with pytest.raises(ValueError, match="1-D int64"):
        ops.embed(torch.tensor([0], dtype=torch.int32), packed, torch.float32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ops.embed(torch.tensor([0]), packed, torch.float16)
    rows = quantize_rows(torch.randn(4, 64), "Q8_0")
    with pytest.raises(ValueError, match="each must be 68 bytes"):
        ops.pack(8, rows[:, :-1], 64)
    with pytest.raises(ValueError, match="not Q4_0 rows"):
        ops.pack(2, rows, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.pack(8, rows, 60)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(FORMAT_NAMES),
    n=st.integers(1, 70),
    blocks=st.integers(1, 5),
    m=st.integers(1, 20),
    seed=st.integers(0, 2**16),
)
# row 19's third block has x * (127 / amax) at exactly -12.5 in fp32 (to even: -12)
@example(name="Q4_0", n=30, blocks=5, m=20, seed=65535)
def test_random_shapes_match_the_reference(ops, name, n, blocks, m, seed):
    k = blocks * BLOCK
    _, x, rows = _case(n, k, m, name, seed)
    fmt = FORMATS[name]
    out = ops.linear(x, ops.pack(fmt, rows, k), None)
    ref = reference(x, rows, name)
    scale = quantized_activations(x).abs() @ dequantize_rows(rows, name).double().abs().T + 1
    assert ((out.double() - ref).abs() / scale).max() < 1e-5


# the emulated AMX level too: the quantized Linear on AMX tiles
@pytest.fixture(scope="module", params=runnable_levels(emulated_amx=True))
def ops_at_level(request) -> QuantOps:
    return QuantOps(kernels_at_level(request).lib)


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_level_gives_the_native_builds_bits(ops, ops_at_level, name, dtype):
    """Every level's dot products (AVX-512 VNNI, AVX2 with VNNI or vpmaddubsw, portable)
    are the same integer sums, scaled and added in the same order: the native build's
    bits at every row count, whether a call's rows make one register block, several, or
    a partial last one (the AVX2 blocks are 4 rows, the AVX-512 ones 6)."""
    n, k = 40, 192
    weight, x, rows = _case(n, k, 33, name, seed=5)
    x = x.to(dtype)
    fmt = FORMATS[name]
    mine, theirs = ops.pack(fmt, rows, k), ops_at_level.pack(fmt, rows, k)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 33):
        want = ops.linear(x[:m], mine, None)
        assert torch.equal(ops_at_level.linear(x[:m], theirs, None), want), m


def extreme_rows(name: str, n: int, k: int) -> torch.Tensor:
    """GGUF rows whose quants sit at the format's extremes: every nibble 15, every
    nibble 0, or the two alternating by byte (Q4); every quant 127, -128 or -127 (Q8_0);
    positive fp16 scales (and for Q4_1 a negative minimum)."""
    from engine.kernels.quant import GGUF_BLOCK_BYTES

    fmt, nb = FORMATS[name], k // BLOCK
    size, head = GGUF_BLOCK_BYTES[fmt], 4 if name == "Q4_1" else 2
    blocks = torch.zeros(n, nb, size, dtype=torch.uint8)
    blocks[:, :, 0:2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    if name == "Q4_1":
        blocks[:, :, 2:4] = torch.tensor([-0.05], dtype=torch.float16).view(torch.uint8)
    patterns = (
        [[0xFF], [0x00], [0xFF, 0x00]] if name != "Q8_0" else [[127], [0x80], [0x81], [127, 0x80]]
    )
    for row in range(n):
        pattern = torch.tensor(patterns[row % len(patterns)], dtype=torch.uint8)
        blocks[row, :, head:] = pattern.repeat((size - head) // len(pattern) + 1)[: size - head]
    return blocks.reshape(n, nb * size)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_extreme_quants_match_the_reference_at_every_level(ops_at_level, name):
    """The integer sums at their largest: activations that quantize to +-127 everywhere
    against quants at the format's extremes. The AVX2 path without VNNI adds a Q4
    block's vpmaddubsw products in int16 (at most 30,480 in size here, 32,767 the
    limit): an overflow or a saturating add would show as a wrong sum."""
    n, k, m = 40, 128, 5
    rows = extreme_rows(name, n, k)
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])
    x = signs[:, None] * torch.ones(m, k)
    x[2, 1::2] = -1.0  # alternating signs in one row
    x[4] = torch.linspace(-3.0, 3.0, k)  # a row that is not all +-127
    out = ops_at_level.linear(x, ops_at_level.pack(FORMATS[name], rows, k), None)
    ref = reference(x, rows, name)
    scale = quantized_activations(x).abs() @ dequantize_rows(rows, name).double().abs().T + 1
    assert ((out.double() - ref).abs() / scale).max() < 1e-5


def test_gguf_block_sizes_agree_with_gguf():
    from engine.kernels.quant import GGUF_BLOCK_BYTES

    for name, fmt in FORMATS.items():
        kind = getattr(gguf.GGMLQuantizationType, name)
        block, size = gguf.GGML_QUANT_SIZES[kind]
        assert (block, size) == (BLOCK, GGUF_BLOCK_BYTES[fmt])
    assert np.dtype(np.uint8).itemsize == 1
