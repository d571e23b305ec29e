"""Misuse of the CPU kernel wrappers: a one-line ValueError, never a crash or garbage.

Each wrapper gets valid arguments with one thing broken (rank, dtype, device, layout,
a length that must agree, an index C reads through), in float32 and again with every
float32 tensor made bfloat16 (same shape, strides and offset), so each case reaches the
same check through the other entry point; a call mixing the two dtypes is refused. The
hypothesis tests draw random shapes and indices, valid or not, in both dtypes, and
hold the kernels to a Python statement of the contract: valid input computes the
reference result, invalid input raises ValueError. An out-of-bounds access in C would
show as a crash of this process or a wrong result.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kernels.cpu import CpuKernels, cpu_kernels
from engine.models.layers import apply_rope
from tests.engine.test_cpu_kernels import (
    BF16_ATTENTION_TOL,
    DTYPES,
    assert_bf16_close,
    same_bits,
)

_I32 = torch.int32
_BF16 = torch.bfloat16
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    k = cpu_kernels()
    if k is None:
        pytest.fail("CPU kernels failed to build; see the warning logged by cpu_kernels()")
    return k


def _refused(call, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert "\n" not in str(info.value)


def _as(dtype: torch.dtype, t):
    """A float32 tensor in ``dtype`` with the same shape, strides and storage offset
    (views stay views: an expanded or strided case stays broken the same way); anything
    else as it is."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or dtype == torch.float32:
        return t
    if t.layout != torch.strided:
        return t.to(dtype)
    base = t if t._base is None else t._base
    return base.to(dtype).as_strided(t.shape, t.stride(), t.storage_offset())


def _all_as(dtype: torch.dtype, args: dict) -> dict:
    return {name: _as(dtype, value) for name, value in args.items()}


# ---- paged_attention: 3 sequences of 1 query token, 4 heads over 2 KV heads of 8 ----


def _attention(**overrides) -> dict:
    args = dict(
        out=torch.zeros(3, 4, 8),
        query=torch.randn(3, 4, 8),
        k_cache=torch.randn(4, 16, 2, 8),
        v_cache=torch.randn(4, 16, 2, 8),
        block_tables=torch.tensor([[1], [2], [3]], dtype=_I32),
        seq_lens=torch.tensor([5, 9, 3], dtype=_I32),
        query_start_loc=torch.tensor([0, 1, 2, 3], dtype=_I32),
        seq_ids=torch.arange(3, dtype=_I32),
        max_query_len=1,
        scale=0.3,
    )
    return args | overrides


_ATTENTION_MISUSE = {
    "query 2-D": ({"query": torch.randn(3, 32)}, "query must be 3-D"),
    "query fp16": (
        {"query": torch.randn(3, 4, 8, dtype=torch.float16)},
        "query must be a float32 or bfloat16 CPU tensor, got torch.float16",
    ),
    "query on meta": (
        {"query": torch.randn(3, 4, 8, device="meta")},
        "query must be a float32 or bfloat16 CPU",
    ),
    "query heads strided": (
        {"query": torch.randn(3, 8, 4).transpose(1, 2)},
        "query must be contiguous",
    ),
    "out rows overlap": ({"out": torch.zeros(1, 4, 8).expand(3, 4, 8)}, "out must be contiguous"),
    "out shape": ({"out": torch.zeros(2, 4, 8)}, r"out \(2, 4, 8\) != query"),
    "k_cache 3-D": ({"k_cache": torch.randn(4, 16, 16)}, "k_cache must be 4-D"),
    "k_cache strided": (
        {"k_cache": torch.randn(16, 4, 2, 8).transpose(0, 1)},
        "k_cache must be contiguous",
    ),
    "v_cache smaller": ({"v_cache": torch.randn(1, 16, 2, 8)}, r"v_cache .* != k_cache"),
    "block_size 0": (
        {"k_cache": torch.zeros(4, 0, 2, 8), "v_cache": torch.zeros(4, 0, 2, 8)},
        "block_size, num_kv_heads and head_dim must be >= 1",
    ),
    "no kv heads": (
        {"k_cache": torch.zeros(4, 16, 0, 8), "v_cache": torch.zeros(4, 16, 0, 8)},
        "must be >= 1",
    ),
    "heads not a multiple": (
        {"k_cache": torch.randn(4, 16, 3, 8), "v_cache": torch.randn(4, 16, 3, 8)},
        "do not fit KV cache",
    ),
    "head_dim differs": (
        {"k_cache": torch.randn(4, 16, 2, 4), "v_cache": torch.randn(4, 16, 2, 4)},
        "do not fit KV cache",
    ),
    "block_tables int64": (
        {"block_tables": torch.tensor([[1], [2], [3]])},
        "block_tables must be an int32",
    ),
    "block_tables 1-D": (
        {"block_tables": torch.tensor([1, 2, 3], dtype=_I32)},
        "block_tables must be 2-D",
    ),
    "block_tables column-major": (
        {"block_tables": torch.tensor([[1, 2, 3], [0, 0, 0]], dtype=_I32).t()},
        "block_tables must be contiguous along its rows",
    ),
    "seq_lens 2-D": ({"seq_lens": torch.tensor([[5, 9, 3]], dtype=_I32)}, "seq_lens must be 1-D"),
    "seq_lens strided": (
        {"seq_lens": torch.tensor([5, 0, 9, 0, 3, 0], dtype=_I32)[::2]},
        "seq_lens must be contiguous",
    ),
    "seq_lens short": ({"seq_lens": torch.tensor([5, 9], dtype=_I32)}, "disagree on the sequences"),
    "query_start_loc short": (
        {"query_start_loc": torch.tensor([0, 1, 2], dtype=_I32)},
        "disagree on the sequences",
    ),
    "seq_ids float": ({"seq_ids": torch.tensor([0.0, 1.0])}, "seq_ids must be an int32"),
    "seq_ids past the end": (
        {"seq_ids": torch.tensor([3], dtype=_I32)},
        "a sequence id outside seq_lens",
    ),
    "seq_ids negative": ({"seq_ids": torch.tensor([-1], dtype=_I32)}, "sequence id outside"),
    "max_query_len negative": ({"max_query_len": -1}, r"max_query_len=-1 must be in \[0, 3\]"),
    "max_query_len past the tokens": ({"max_query_len": 4}, r"must be in \[0, 3\]"),
    "max_query_len too small": (
        {
            "query_start_loc": torch.tensor([0, 2, 2, 3], dtype=_I32),
            "seq_ids": torch.tensor([0], dtype=_I32),
        },
        "more than max_query_len=1",
    ),
    "block id past the cache": (
        {"block_tables": torch.tensor([[9], [2], [3]], dtype=_I32)},
        r"block id outside 0\.\.3",
    ),
    "block id negative": (
        {"block_tables": torch.tensor([[-1], [2], [3]], dtype=_I32)},
        "block id outside",
    ),
    "seq_len past the table": (
        {"seq_lens": torch.tensor([40, 9, 3], dtype=_I32)},
        "do not fit the block table",
    ),
    "seq_len negative": ({"seq_lens": torch.tensor([-5, 9, 3], dtype=_I32)}, "do not fit"),
    "query range backwards": (
        {"query_start_loc": torch.tensor([0, 2, 1, 3], dtype=_I32)},
        "do not fit",
    ),
    "query range past the tokens": (
        {"query_start_loc": torch.tensor([0, 1, 2, 9], dtype=_I32)},
        "do not fit",
    ),
    # int32 extremes: in 32-bit arithmetic q_len, the block count and the row count
    # wrapped around and a negative size reached memset
    "int32 extremes": (
        {
            "seq_lens": torch.tensor([5, _INT32_MAX, 3], dtype=_I32),
            "query_start_loc": torch.tensor([0, 1, _INT32_MIN, 3], dtype=_I32),
        },
        "do not fit",
    ),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(_ATTENTION_MISUSE))
def test_paged_attention_refuses(kernels, case, dtype):
    overrides, match = _ATTENTION_MISUSE[case]
    args = _all_as(dtype, _attention(**overrides))
    _refused(lambda: kernels.paged_attention(**args), match)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_baseline_is_valid(kernels, dtype):
    """The arguments the cases above break one at a time are themselves accepted."""
    args = _all_as(dtype, _attention())
    kernels.paged_attention(**args)
    assert torch.isfinite(args["out"]).all()


# One float argument in the other dtype: (kernel, argument) -> the dtype the call has.
_MIXED = {
    ("paged_attention", "out"): "query",
    ("paged_attention", "k_cache"): "query",
    ("paged_attention", "v_cache"): "query",
    ("rms_norm", "weight"): "x",
    ("rms_norm", "residual"): "x",
    ("rope", "cos_sin"): "x",
    ("write_kv", "value"): "key",
    ("write_kv", "k_cache"): "key",
    ("write_kv", "v_cache"): "key",
}


def _valid_args(kernel: str) -> dict:
    if kernel == "paged_attention":
        return _attention()
    if kernel == "rms_norm":
        return {"x": _X.clone(), "weight": _W, "eps": 1e-5, "residual": torch.randn(4, 96)}
    return _rope() if kernel == "rope" else _write()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kernel", "name"), list(_MIXED))
def test_mixed_dtypes_are_refused(kernels, kernel, name, dtype):
    """The call's dtype is its first float argument's; any other float argument in
    another dtype is named, with both dtypes, before anything is written."""
    other = _BF16 if dtype == torch.float32 else torch.float32
    args = _all_as(dtype, _valid_args(kernel))
    args[name] = args[name].to(other)
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    first = _MIXED[(kernel, name)]
    if name == "k_cache" and other == _BF16:
        # a bf16 cache under float32 rows is --kv-cache-dtype bfloat16: then v_cache,
        # still float32, is the odd one out
        name, other, first, dtype = "v_cache", dtype, "k_cache", other
    _refused(
        lambda: getattr(kernels, kernel)(**args),
        f"^{name} is {other} but {first} is {dtype}: the float tensors of one call must "
        "share one dtype$",
    )
    for k, v in before.items():
        assert torch.equal(args[k], v), k


@pytest.mark.parametrize("kernel", ["paged_attention", "rms_norm", "rope", "write_kv"])
def test_bf16_baselines_are_valid(kernels, kernel):
    """The bf16 twins of the arguments the mixed cases break are accepted."""
    getattr(kernels, kernel)(**_all_as(_BF16, _valid_args(kernel)))


# ---- rms_norm, rope, write_kv, silu_and_mul ----

_X, _W = torch.randn(4, 96), torch.randn(96)
_NORM_MISUSE = {
    "x 1-D": ((torch.randn(96), _W), {}, "x must be 2-D"),
    "x 3-D": ((torch.randn(2, 4, 96), _W), {}, "x must be 2-D"),
    "x int": ((torch.ones(4, 96, dtype=_I32), _W), {}, "x must be a float32 or bfloat16"),
    "x sparse": ((torch.randn(4, 96).to_sparse(), _W), {}, r"x must be a float32 .*sparse"),
    "x transposed": ((torch.randn(96, 4).t(), _W), {}, "x must be contiguous"),
    "1-element weight": ((_X, torch.randn(1)), {}, r"weight \[1\] must be \[96\]"),
    "long weight": ((_X, torch.randn(97)), {}, r"weight \[97\] must be \[96\]"),
    "weight 2-D": ((_X, torch.randn(1, 96)), {}, "weight must be 1-D"),
    "weight strided": ((_X, torch.randn(192)[::2]), {}, "weight must be contiguous"),
    "residual shape": ((_X, _W), {"residual": torch.randn(3, 96)}, r"residual .* != x"),
    "residual strided": (
        (_X, _W),
        {"residual": torch.randn(96, 4).t()},
        "residual must be contiguous",
    ),
    "residual fp16": (
        (_X, _W),
        {"residual": torch.randn(4, 96, dtype=torch.float16)},
        "residual must be a float32",
    ),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(_NORM_MISUSE))
def test_rms_norm_refuses(kernels, case, dtype):
    (x, weight), kwargs, match = _NORM_MISUSE[case]
    x, weight, kwargs = _as(dtype, x), _as(dtype, weight), _all_as(dtype, kwargs)
    _refused(lambda: kernels.rms_norm(x, weight, 1e-5, **kwargs), match)


def test_rms_norm_tiny_weight_for_a_huge_input_is_refused(kernels):
    """The reported crash: a 1-element weight for a 2^24-element input."""
    _refused(lambda: kernels.rms_norm(torch.ones(1, 2**24), torch.ones(1), 1e-5), "weight")


def _rope(**overrides) -> dict:
    args = dict(
        x=torch.randn(5, 80),  # 4 rotated heads of 16, then 16 untouched
        positions=torch.arange(5),
        cos_sin=torch.randn(10, 2, 8),
        num_rotated=4,
    )
    return args | overrides


_ROPE_MISUSE = {
    "x 3-D": ({"x": torch.randn(5, 5, 16)}, "x must be 2-D"),
    "x float64": ({"x": torch.randn(5, 80, dtype=torch.float64)}, "x must be a float32"),
    "x columns strided": ({"x": torch.randn(80, 5).t()}, "x must be contiguous"),
    "x rows overlap": ({"x": torch.randn(1, 80).expand(5, 80)}, "x must be contiguous"),
    "cos_sin 2-D": ({"cos_sin": torch.randn(10, 16)}, "cos_sin must be 3-D"),
    "cos_sin without sin": (
        {"cos_sin": torch.randn(10, 1, 16)},
        r"must be \[max_positions, 2, head_dim // 2\]",
    ),
    "cos_sin empty": ({"cos_sin": torch.randn(10, 2, 0)}, r"must be \[max_positions, 2"),
    "cos_sin strided": ({"cos_sin": torch.randn(8, 2, 10).transpose(0, 2)}, "must be contiguous"),
    "too many heads": ({"num_rotated": 6}, r"num_rotated=6 heads of 16 must fit in x \(5, 80\)"),
    "negative heads": ({"num_rotated": -1}, "num_rotated=-1"),
    "positions int32": ({"positions": torch.arange(5, dtype=_I32)}, "positions must be an int64"),
    "positions short": ({"positions": torch.arange(4)}, r"positions \(4,\) must be \[5\]"),
    "positions strided": ({"positions": torch.arange(10)[::2]}, "must be \\[5\\] and contiguous"),
    "position past the table": (
        {"positions": torch.tensor([0, 1, 2, 3, 10])},
        r"outside the rotary table's 0\.\.9",
    ),
    "position negative": ({"positions": torch.tensor([0, -1, 2, 3, 4])}, "outside the rotary"),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(_ROPE_MISUSE))
def test_rope_refuses(kernels, case, dtype):
    overrides, match = _ROPE_MISUSE[case]
    args = _all_as(dtype, _rope(**overrides))
    before = args["x"].clone()
    _refused(lambda: kernels.rope(**args), match)
    assert torch.equal(args["x"], before)  # nothing rotated before refusing


def _write(**overrides) -> dict:
    args = dict(
        key=torch.randn(3, 2, 8),
        value=torch.randn(3, 2, 8),
        k_cache=torch.zeros(3, 4, 2, 8),
        v_cache=torch.zeros(3, 4, 2, 8),
        slots=torch.tensor([5, -1, 11]),
    )
    return args | overrides


_WRITE_MISUSE = {
    "v_cache smaller": ({"v_cache": torch.zeros(1, 4, 2, 8)}, r"v_cache .* != k_cache"),
    "k_cache 3-D": ({"k_cache": torch.zeros(3, 4, 16)}, "k_cache must be 4-D"),
    "k_cache strided": ({"k_cache": torch.zeros(4, 3, 2, 8).transpose(0, 1)}, "contiguous"),
    "key 2-D": ({"key": torch.randn(3, 16)}, "key must be 3-D"),
    "key heads strided": ({"key": torch.randn(3, 8, 2).transpose(1, 2)}, "key must be contiguous"),
    "value rows overlap": (
        {"value": torch.randn(1, 2, 8).expand(3, 2, 8)},
        "value must be contiguous",
    ),
    "key heads differ": ({"key": torch.randn(3, 1, 8)}, "do not fit cache"),
    "value shorter": ({"value": torch.randn(2, 2, 8)}, "do not fit cache"),
    "key fp64": ({"key": torch.randn(3, 2, 8, dtype=torch.float64)}, "key must be a float32"),
    "slots int32": ({"slots": torch.tensor([5, -1, 11], dtype=_I32)}, "slots must be an int64"),
    "slots short": ({"slots": torch.tensor([5, 6])}, r"slots \(2,\) must be \[3\]"),
    "slot past the cache": ({"slots": torch.tensor([0, 1, 12])}, "past the cache's 12 slots"),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(_WRITE_MISUSE))
def test_write_kv_refuses(kernels, case, dtype):
    overrides, match = _WRITE_MISUSE[case]
    args = _all_as(dtype, _write(**overrides))
    _refused(lambda: kernels.write_kv(**args), match)
    assert not args["k_cache"].any() and not args["v_cache"].any()  # nothing written


_SILU_MISUSE = {
    "odd width": (torch.randn(4, 5), "x's width 5 must be even"),
    "1-D": (torch.randn(8), "x must be 2-D"),
    "3-D": (torch.randn(2, 4, 8), "x must be 2-D"),
    "transposed": (torch.randn(8, 4).t(), "x must be contiguous"),
    "fp16": (torch.randn(4, 8, dtype=torch.float16), "x must be a float32"),
    "meta": (torch.randn(4, 8, device="meta"), "x must be a float32 or bfloat16 CPU tensor"),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(_SILU_MISUSE))
def test_silu_and_mul_refuses(kernels, case, dtype):
    x, match = _SILU_MISUSE[case]
    x = _as(dtype, x)
    _refused(lambda: kernels.silu_and_mul(x), match)


# ---- random shapes and indices against the contract ----

_SETTINGS = settings(max_examples=60, deadline=None)
_index = st.one_of(st.integers(-3, 20), st.integers(_INT32_MIN, _INT32_MAX))


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[1],), weight, 1e-5)
    # the model's bf16 path (layers.RMSNorm._norm)
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@_SETTINGS
@given(rows=st.integers(0, 5), width=st.integers(0, 9), weight_len=st.integers(0, 9))
def test_rms_norm_and_silu_random_shapes(kernels, dtype, rows, width, weight_len):
    x = torch.randn(rows, width).to(dtype)
    weight = torch.randn(weight_len).to(dtype)
    if weight_len == width:
        out, expected = kernels.rms_norm(x, weight, 1e-5), _torch_rms_norm(x, weight)
        if dtype == torch.float32:
            torch.testing.assert_close(out, expected)
        else:
            assert_bf16_close(out, expected, max_ulps=2, max_fraction=1.0)
    else:
        _refused(lambda: kernels.rms_norm(x, weight, 1e-5), "weight")
    if width % 2 == 0:
        gate, up = x.split(width // 2, dim=1) if width else (x, x)
        out, expected = kernels.silu_and_mul(x), F.silu(gate) * up
        if dtype == torch.float32:
            torch.testing.assert_close(out, expected)
        else:
            assert same_bits(out, expected)
    else:
        _refused(lambda: kernels.silu_and_mul(x), "must be even")


@pytest.mark.parametrize("dtype", DTYPES)
@_SETTINGS
@given(
    data=st.data(),
    num_tokens=st.integers(0, 6),
    half=st.integers(1, 4),
    num_positions=st.integers(1, 8),
    num_rotated=st.integers(-1, 4),
    extra=st.integers(0, 5),
)
def test_rope_random(kernels, dtype, data, num_tokens, half, num_positions, num_rotated, extra):
    head_dim = 2 * half
    width = 3 * head_dim + extra
    x = torch.randn(num_tokens, width).to(dtype)
    positions = torch.tensor(data.draw(st.lists(_index, min_size=num_tokens, max_size=num_tokens)))
    positions = positions.to(torch.int64).reshape(num_tokens)
    cos_sin = torch.randn(num_positions, 2, half).to(dtype)
    args = (x, positions, cos_sin, num_rotated)
    if not 0 <= num_rotated * head_dim <= width:
        return _refused(lambda: kernels.rope(*args), "num_rotated")
    if any(not 0 <= p < num_positions for p in positions.tolist()):
        return _refused(lambda: kernels.rope(*args), "outside the rotary table")
    width_rotated = num_rotated * head_dim
    qk = x[:, :width_rotated].reshape(num_tokens, num_rotated, head_dim)
    cs = cos_sin[positions]
    expected = apply_rope(qk, cs[:, 0:1], cs[:, 1:2]).reshape(num_tokens, width_rotated)
    rest = x[:, width_rotated:].clone()
    kernels.rope(*args)
    if dtype == torch.float32:
        torch.testing.assert_close(x[:, :width_rotated], expected)
    else:  # rounded as torch's bf16 ops round
        assert same_bits(x[:, :width_rotated].contiguous(), expected.contiguous())
    assert torch.equal(x[:, width_rotated:], rest)


@pytest.mark.parametrize("dtype", DTYPES)
@_SETTINGS
@given(
    data=st.data(),
    num_tokens=st.integers(0, 5),
    num_blocks=st.integers(1, 4),
    block_size=st.integers(1, 3),
    kv_heads=st.integers(1, 2),
)
def test_write_kv_random(kernels, dtype, data, num_tokens, num_blocks, block_size, kv_heads):
    num_slots = num_blocks * block_size
    slots = data.draw(st.lists(_index, min_size=num_tokens, max_size=num_tokens))
    key = torch.randn(num_tokens, kv_heads, 4).to(dtype)
    value = torch.randn(num_tokens, kv_heads, 4).to(dtype)
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, 4, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    args = (key, value, k_cache, v_cache, torch.tensor(slots, dtype=torch.int64))
    if any(s >= num_slots for s in slots):
        _refused(lambda: kernels.write_kv(*args), "past the cache")
        assert not k_cache.any() and not v_cache.any()
        return
    kernels.write_kv(*args)
    expected_k, expected_v = (
        torch.zeros(num_slots, kv_heads, 4, dtype=dtype),
        torch.zeros(num_slots, kv_heads, 4, dtype=dtype),
    )
    for i, s in enumerate(slots):
        if s >= 0:
            expected_k[s], expected_v[s] = key[i], value[i]
    assert torch.equal(k_cache.view(num_slots, kv_heads, 4), expected_k)
    assert torch.equal(v_cache.view(num_slots, kv_heads, 4), expected_v)


@st.composite
def _attention_case(draw):
    """Valid paged-attention metadata, then maybe one index corrupted."""
    kv_heads, group = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    block_size, num_blocks = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    num_seqs = draw(st.integers(1, 3))
    q_lens = [draw(st.integers(1, 3)) for _ in range(num_seqs)]
    seq_lens = [q + draw(st.integers(0, 6)) for q in q_lens]
    width = max(-(-s // block_size) for s in seq_lens) + draw(st.integers(0, 1))
    tables = [[draw(st.integers(0, num_blocks - 1)) for _ in range(width)] for _ in seq_lens]
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    seq_ids = draw(st.lists(st.integers(0, num_seqs - 1), min_size=1, max_size=num_seqs))
    max_query_len, num_tokens = max(q_lens[s] for s in seq_ids), qsl[-1]
    meta = {"tables": tables, "seq_lens": seq_lens, "qsl": qsl, "seq_ids": seq_ids}
    target = draw(st.sampled_from(["none", "tables", "seq_lens", "qsl", "seq_ids", "max"]))
    if target == "max":
        max_query_len = draw(st.integers(-2, num_tokens + 2))
    elif target != "none":
        row = meta[target] if target != "tables" else tables[draw(st.integers(0, num_seqs - 1))]
        row[draw(st.integers(0, len(row) - 1))] = draw(_index)
    return (kv_heads, group, block_size, num_blocks), meta, max_query_len, num_tokens


def _attention_valid(meta, max_query_len, num_tokens, group, block_size, num_blocks) -> bool:
    """The kernel's contract, stated in Python for the selected sequences."""
    if not 0 <= max_query_len <= num_tokens:
        return False
    for s in meta["seq_ids"]:
        if not 0 <= s < len(meta["seq_lens"]):
            return False
        start, stop, seq_len = meta["qsl"][s], meta["qsl"][s + 1], meta["seq_lens"][s]
        q_len, needed = stop - start, -(-seq_len // block_size)
        if not (1 <= q_len <= seq_len and start >= 0 and stop <= num_tokens):
            return False
        if needed > len(meta["tables"][s]) or group * q_len > max(group * max_query_len, 1):
            return False
        if any(not 0 <= b < num_blocks for b in meta["tables"][s][:needed]):
            return False
    return True


def _reference_attention(query, k_cache, v_cache, meta, s, group, scale):
    start, stop, seq_len = meta["qsl"][s], meta["qsl"][s + 1], meta["seq_lens"][s]
    blocks = meta["tables"][s][: -(-seq_len // k_cache.shape[1])]  # entries past are unread
    keys = torch.cat([k_cache[b] for b in blocks])[:seq_len]
    vals = torch.cat([v_cache[b] for b in blocks])[:seq_len]
    keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, seq_len, hd]
    vals = vals.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = query[start:stop].transpose(0, 1) @ keys.transpose(1, 2) * scale
    q_pos = torch.arange(seq_len - (stop - start), seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
    return (scores.softmax(-1) @ vals).transpose(0, 1)  # [q_len, heads, hd]


@pytest.mark.parametrize("dtype", DTYPES)
@_SETTINGS
@given(case=_attention_case())
def test_paged_attention_random(kernels, dtype, case):
    (kv_heads, group, block_size, num_blocks), meta, max_query_len, num_tokens = case
    k_cache = torch.randn(num_blocks, block_size, kv_heads, 4).to(dtype)
    v_cache = torch.randn_like(k_cache)
    query = torch.randn(num_tokens, kv_heads * group, 4).to(dtype)
    out = torch.full_like(query, float("nan"))

    def call():
        kernels.paged_attention(
            out,
            query,
            k_cache,
            v_cache,
            torch.tensor(meta["tables"], dtype=_I32),
            torch.tensor(meta["seq_lens"], dtype=_I32),
            torch.tensor(meta["qsl"], dtype=_I32),
            torch.tensor(meta["seq_ids"], dtype=_I32),
            max_query_len,
            0.5,
        )

    if not _attention_valid(meta, max_query_len, num_tokens, group, block_size, num_blocks):
        return _refused(call, "max_query_len|block id")
    call()
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else BF16_ATTENTION_TOL
    for s in set(meta["seq_ids"]):
        expected = _reference_attention(
            query.float(), k_cache.float(), v_cache.float(), meta, s, group, 0.5
        )
        rows = out[meta["qsl"][s] : meta["qsl"][s + 1]].float()
        torch.testing.assert_close(rows, expected, **tol)
