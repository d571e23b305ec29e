"""Every compiled kernel with NaN and +-Inf among its inputs: the output is non-finite
exactly where float math (a torch reference) makes it so, close to the reference where
that is finite, and bit-identical to the clean run wherever the poisoned value does not
reach (other rows of the batch, other sequences, earlier query positions).

A model that produces NaN must not produce plausible tokens from it: the quantized
Linear used to quantize a NaN activation block to garbage int8 and return finite
outputs. Each kernel runs at every instruction-set level this CPU can execute (the
-march=native build, and build.py's prebuilt levels), since the levels compile
different code: the quantized Linear's avx512-vnni, avx2 (+vnni) and portable paths, the
bf16 attention's vdpbf16ps path, the logits mask's AVX-512 loop.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu import CpuKernels, cpu_kernels
from engine.kernels.quant import FORMATS, GGUF_BLOCK_BYTES, QuantOps
from engine.loader import load_model
from engine.models.layers import RMSNorm, apply_rope
from engine.sample.grammar import mask_logits
from tests.engine.kernel_levels import kernels_at_level, runnable_levels
from tests.engine.simple_runner import SimplePagedRunner
from tests.engine.test_quant_kernels import dequantize_rows, quantize_rows

NONFINITE = [
    pytest.param(float("nan"), id="nan"),
    pytest.param(float("inf"), id="+inf"),
    pytest.param(float("-inf"), id="-inf"),
]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# Finite outputs of a poisoned call against the float64 reference (attention's -inf
# scores drop a key; a row holding +-Inf normalises its other elements to 0): the
# kernels' usual tolerances.
CLOSE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 4e-3, "atol": 1e-5}}


# the emulated AMX level too: the bf16 Linear and quantized calls on AMX tiles
@pytest.fixture(scope="module", params=runnable_levels(emulated_amx=True))
def kernels(request) -> CpuKernels:
    return kernels_at_level(request)


@pytest.fixture(scope="module")
def quant(kernels) -> QuantOps:
    return QuantOps(kernels.lib)


def poisoned(x: torch.Tensor, index: tuple, value: float) -> torch.Tensor:
    out = x.clone()
    out[index] = value
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (torch.equal takes -0.0 for 0.0 and no NaN for itself)."""
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
    return a.dtype == b.dtype and torch.equal(a.view(as_int[a.dtype]), b.view(as_int[b.dtype]))


def assert_contained(out, clean, ref, clean_ref, close: dict | None = None) -> None:
    """``out`` (a poisoned call) is non-finite exactly where ``ref`` (float math on the
    poisoned inputs) is; wherever ``ref`` equals ``clean_ref`` (the poison does not reach)
    it is ``clean`` (the kernel on clean inputs) bit for bit; elsewhere, where finite,
    close to ``ref``."""
    bad, expected = ~torch.isfinite(out.double()), ~torch.isfinite(ref)
    assert expected.any()  # the poison reaches something
    assert torch.equal(bad, expected), (
        f"non-finite at {bad.nonzero().tolist()[:8]} ({int(bad.sum())}), "
        f"float math: {expected.nonzero().tolist()[:8]} ({int(expected.sum())})"
    )
    unreached = ref == clean_ref
    assert same_bits(out[unreached], clean[unreached])
    reached = ~unreached & ~expected
    if close is not None and reached.any():
        torch.testing.assert_close(out.double()[reached], ref[reached], **close)


# --- Linear layers -----------------------------------------------------------------


@pytest.mark.parametrize("value", NONFINITE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(FORMATS))
def test_quant_linear_propagates_a_nonfinite_activation(quant, name, dtype, value):
    """One bad activation makes every output of its row non-finite (a float Linear's
    NaN or +-Inf); the 8 other rows, in the same register blocks, are untouched."""
    gen = torch.Generator().manual_seed(0)
    n, k, m = 40, 96, 9
    rows = quantize_rows(torch.randn(n, k, generator=gen) * 0.05, name)
    weight = quant.pack(FORMATS[name], rows, k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    w = dequantize_rows(rows, name).double()
    for index in [(6, 37), (0, 95), (3, 0)]:  # blocks 1, 2 and 0; rows in both blocks
        bad = poisoned(x, index, value)
        out = quant.linear(bad, weight, bias)
        ref = bad.double() @ w.T + bias.double()
        assert_contained(out, quant.linear(x, weight, bias), ref, x.double() @ w.T + bias.double())


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # gguf: inf * 0
@pytest.mark.parametrize("value", NONFINITE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(FORMATS))
def test_quant_linear_and_embedding_propagate_a_nonfinite_weight_scale(quant, name, dtype, value):
    """A block whose fp16 scale is NaN or Inf: its output's column (the Linear) and its
    row (the embedding) are non-finite as dequantized float math makes them."""
    gen = torch.Generator().manual_seed(1)
    n, k, m, bad_row, block = 40, 96, 5, 21, 1
    fmt = FORMATS[name]
    clean_rows = quantize_rows(torch.randn(n, k, generator=gen) * 0.05, name)
    rows = clean_rows.clone()
    at = block * GGUF_BLOCK_BYTES[fmt]
    rows[bad_row, at : at + 2] = torch.tensor([value], dtype=torch.float16).view(torch.uint8)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w, clean_w = dequantize_rows(rows, name).double(), dequantize_rows(clean_rows, name).double()
    weight, clean_weight = quant.pack(fmt, rows, k), quant.pack(fmt, clean_rows, k)
    out = quant.linear(x, weight, None)
    clean = quant.linear(x, clean_weight, None)
    assert_contained(out, clean, x.double() @ w.T, x.double() @ clean_w.T)
    ids = torch.tensor([3, bad_row, 39])
    embedded = quant.embed(ids, weight, dtype)
    assert_contained(embedded, quant.embed(ids, clean_weight, dtype), w[ids], clean_w[ids])


@pytest.mark.parametrize("value", NONFINITE)
@pytest.mark.parametrize("where", ["x", "weight"])
@pytest.mark.parametrize("column", [5, 70])  # 70: an odd k's last column, paired with 0
@pytest.mark.parametrize("mode", ["vdpbf16ps", "fma", "amx"])
def test_bf16_linear_propagates_nonfinite_inputs(kernels, where, column, value, mode):
    if mode not in kernels.bf16_linear_modes:
        pytest.skip(f"this level has no {mode} bf16 Linear kernel")
    before = kernels.set_bf16_linear(mode)
    try:
        _bf16_linear_propagates(kernels, where, column, value)
    finally:
        kernels.set_bf16_linear(before)


def _bf16_linear_propagates(kernels, where, column, value) -> None:
    gen = torch.Generator().manual_seed(2)
    n, k, m = 40, 71, 13  # two tiles, the second short; rows past one 12-row block
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(n, k, generator=gen) * 0.1).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    bad_x, bad_w = x, weight
    if where == "x":
        bad_x = poisoned(x, (12, column), value)
    else:
        bad_w = poisoned(weight, (33, column), value)
    out = kernels.linear(bad_x, kernels.pack_linear_weight(bad_w), bias, n)
    clean = kernels.linear(x, kernels.pack_linear_weight(weight), bias, n)
    ref = bad_x.double() @ bad_w.double().T + bias.double()
    assert_contained(out, clean, ref, x.double() @ weight.double().T + bias.double())


@pytest.mark.parametrize("value", NONFINITE)
@pytest.mark.parametrize("where", ["x", "weight"])
@pytest.mark.parametrize("column", [5, 70])  # 70: an odd k's last column (bf16 padding)
@pytest.mark.parametrize("storage", DTYPES)
def test_f32_linear_propagates_nonfinite_inputs(kernels, where, column, value, storage):
    """A bf16-stored weight's pair padding is never multiplied: 0 * Inf there would be a
    NaN that float math does not make."""
    if not kernels.has_f32_linear:
        pytest.skip("this level has no float32 Linear kernel (no FMA)")
    gen = torch.Generator().manual_seed(2)
    n, k, m = 40, 71, 13
    x = torch.randn(m, k, generator=gen)
    weight = (torch.randn(n, k, generator=gen) * 0.1).to(storage).float()
    bias = torch.randn(n, generator=gen)
    bad_x, bad_w = x, weight
    if where == "x":
        bad_x = poisoned(x, (12, column), value)
    else:
        bad_w = poisoned(weight, (33, column), value)
    out = kernels.linear(bad_x, kernels.pack_linear_weight(bad_w, storage), bias, n)
    clean = kernels.linear(x, kernels.pack_linear_weight(weight, storage), bias, n)
    ref = bad_x.double() @ bad_w.double().T + bias.double()
    clean_ref = x.double() @ weight.double().T + bias.double()
    assert_contained(out, clean, ref, clean_ref, CLOSE[torch.float32])


# --- attention -----------------------------------------------------------------------


def _attention_reference(q, k_cache, v_cache, tables, seq_lens, q_lens, scale):
    """float64, each query over exactly the keys it sees, elementwise (no BLAS): a key
    a query does not see is in none of its sums, where a masked score's 0 weight times a
    NaN value would be."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    start = 0
    for table, seq_len, q_len in zip(tables, seq_lens, q_lens, strict=True):
        keys = torch.cat([k_cache[b] for b in table])[:seq_len].double()  # [s, kvh, hd]
        values = torch.cat([v_cache[b] for b in table])[:seq_len].double()
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        for j in range(q_len):
            seen = seq_len - q_len + j + 1
            scores = (keys[:seen] * q[start + j].double()).sum(-1) * scale  # [seen, h]
            weights = scores.softmax(0)
            out[start + j] = (weights[:, :, None] * values[:seen]).sum(0)
        start += q_len
    return out


@pytest.mark.parametrize("value", NONFINITE)
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("head_dim", [16, 64])  # 64: bf16's vdpbf16ps path
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_propagates_nonfinite_inputs(kernels, dtype, head_dim, where, value):
    """A bad query element spoils its own (token, head); a bad key or value the queries
    of its sequence that see it, in its KV head's group: not the earlier queries of a
    prompt or a verification, whose rows share the bad one's tile and register pass."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, block_size, num_blocks = 4, 2, 16, 16
    q_lens, seq_lens = [20, 1, 5], [20, 35, 40]  # a prompt, a decode, a verification
    tables = [[1, 2], [3, 4, 5], [9, 7, 6]]
    width = 3
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = torch.tensor([0, 20, 21, 26], dtype=torch.int32)

    def attend(q, k_cache, v_cache):
        out = torch.empty_like(q)
        kernels.paged_attention(
            out, q, k_cache, v_cache, table_t, torch.tensor(seq_lens, dtype=torch.int32), qsl,
            torch.arange(3, dtype=torch.int32), max(q_lens), scale,
        )  # fmt: skip
        ref = _attention_reference(q, k_cache, v_cache, tables, seq_lens, q_lens, scale)
        return out, ref

    clean, clean_ref = attend(q, k_cache, v_cache)
    # the prompt's position 7 (block 1, slot 7: queries 0-6 must not see it) and the
    # verification's 37 (its third query; block 6, slot 5); KV head 1, element 3
    for token, slot in [(7, (1, 7)), (23, (6, 5))]:
        bad = {"q": q, "k": k_cache, "v": v_cache}
        if where == "q":
            bad["q"] = poisoned(q, (token, 2, 3), value)
        else:
            bad[where] = poisoned(bad[where], (*slot, 1, 3), value)
        out, ref = attend(bad["q"], bad["k"], bad["v"])
        assert_contained(out, clean, ref, clean_ref, CLOSE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_copies_nonfinite_values_as_they_are(kernels, dtype):
    k_cache = torch.zeros(3, 4, 2, 8, dtype=dtype)
    v_cache = torch.zeros(3, 4, 2, 8, dtype=dtype)
    fused = torch.randn(3, 32).to(dtype)
    fused[0, 3], fused[1, 17], fused[2, 30] = float("nan"), float("inf"), float("-inf")
    key, value = fused[:, :16].view(3, 2, 8), fused[:, 16:].view(3, 2, 8)
    kernels.write_kv(key, value, k_cache, v_cache, torch.tensor([5, 0, 11]))
    flat_k, flat_v = k_cache.view(12, 2, 8), v_cache.view(12, 2, 8)
    for row, slot in enumerate([5, 0, 11]):
        assert same_bits(flat_k[slot], key[row]) and same_bits(flat_v[slot], value[row])


# --- row-wise kernels ----------------------------------------------------------------


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(x.shape[1], eps).to(x.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm._norm(x)


@pytest.mark.parametrize("value", NONFINITE)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rows", [3, 100])  # serial; threaded
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_propagates_nonfinite_inputs(kernels, dtype, rows, residual, value):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    res = torch.randn(rows, 96, generator=gen).to(dtype) if residual else None
    weight = torch.randn(96, generator=gen).to(dtype)
    bad = poisoned(x, (1, 40), value)

    def run(x):
        res_copy = None if res is None else res.clone()
        out = kernels.rms_norm(x, weight, 1e-5, res_copy)
        stream = x if res is None else x + res  # torch's add, as the kernel rounds it
        ref = _torch_rms_norm(stream, weight, 1e-5).double()
        return out, ref, res_copy, stream

    out, ref, new_res, stream = run(bad)
    clean, clean_ref, clean_res, clean_stream = run(x)
    assert_contained(out, clean, ref, clean_ref, CLOSE[dtype])
    if residual:
        assert_contained(new_res, clean_res, stream.double(), clean_stream.double())


@pytest.mark.parametrize("value", NONFINITE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_propagates_nonfinite_inputs(kernels, dtype, value):
    """A bad element spoils the two it is rotated into; unrotated (v) columns are kept."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, n = 4, 2, 16, 70
    width = (heads + 2 * kv_heads) * head_dim
    rotated = heads + kv_heads
    qkv = torch.randn(n, width, generator=gen).to(dtype)
    positions = torch.randint(0, 50, (n,), generator=gen)
    angles = torch.arange(64)[:, None] * torch.rand(head_dim // 2, generator=gen)[None, :]
    cos_sin = torch.stack([angles.cos(), angles.sin()], dim=1).to(dtype)  # [64, 2, hd/2]

    def run(qkv):
        cs = cos_sin[positions]
        qk = qkv[:, : rotated * head_dim].reshape(n, rotated, head_dim)
        ref = torch.cat([apply_rope(qk, cs[:, 0:1], cs[:, 1:2]).reshape(n, -1),
                         qkv[:, rotated * head_dim :]], dim=1)  # fmt: skip
        out = qkv.clone()
        kernels.rope(out, positions, cos_sin, rotated)
        return out, ref.double()

    clean, clean_ref = run(qkv)
    for index in [(3, 5), (66, 5 * head_dim + 12), (10, width - 1)]:  # q, k, v heads
        out, ref = run(poisoned(qkv, index, value))
        assert_contained(out, clean, ref, clean_ref, CLOSE[dtype])


@pytest.mark.parametrize("value", NONFINITE)
@pytest.mark.parametrize("rows", [2, 80])  # serial; threaded
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_propagates_nonfinite_inputs(kernels, dtype, rows, value):
    gen = torch.Generator().manual_seed(6)
    inter = 40
    x = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)

    def reference(x):
        gate, up = x.split(inter, dim=1)
        return (F.silu(gate) * up).double()

    clean = kernels.silu_and_mul(x)
    for index in [(1, 7), (1, inter + 7), (rows - 1, 0)]:  # gate; up; the last row's gate
        bad = poisoned(x, index, value)
        assert_contained(kernels.silu_and_mul(bad), clean, reference(bad), reference(x))


@pytest.mark.parametrize("vocab", [37, 300])  # below and across the 16-lane loop
def test_mask_logits_treats_nonfinite_logits_as_the_torch_path_does(kernels, vocab):
    """Structured output's mask refuses a non-finite logit (grammar.mask_logits, its
    torch path, says so): the same logits, bit for bit, and the same rows left with no
    token; a row whose allowed logits are all NaN is one of them."""
    gen = torch.Generator().manual_seed(7)
    rows, words = 4, -(-vocab // 32)
    logits = torch.randn(rows, vocab, generator=gen)
    logits[0, 3], logits[0, 20], logits[1, vocab - 1] = float("nan"), float("inf"), float("-inf")
    logits[2] = float("nan")
    masks = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=gen, dtype=torch.int32)
    masks[0, 0] = -1  # tokens 3 and 20 allowed: masked for their values alone
    ours, theirs = logits.clone(), logits.clone()
    assert kernels.mask_logits(ours, masks) == mask_logits(theirs, masks) == [2]
    assert same_bits(ours, theirs)


# --- the model: a bad embedding reaches exactly what it reaches in float math ------------


@pytest.mark.parametrize("value", NONFINITE)
@pytest.mark.parametrize(
    ("dtype", "quantization"),
    [("float32", "none"), ("float32", "int8"), ("bfloat16", "none"), ("bfloat16", "int8")],
)
def test_a_bad_hidden_state_gives_nonfinite_logits_where_it_reaches(
    tiny_model_factory, dtype, quantization, value
):
    """One element of one token's embedding made NaN or +-Inf, in a packed step of three
    sequences (bf16: the fused one-call decoder): every logit of that token and of the
    later tokens of its sequence is non-finite, then on into its next decode; every
    other logit is the clean run's, bit for bit. head_dim 32: bf16's vdpbf16ps attention,
    4 query rows per pass. (The poisoned prompt is 12 tokens, short enough for the
    kernel in fp32 too: a longer fp32 chunk goes to torch's SDPA, where a masked key's 0
    weight times a NaN value spoils the earlier tokens of the prompt.)"""
    model_dir = tiny_model_factory(head_dim=32)
    bad_token = 77

    def run(poison: bool) -> list[torch.Tensor]:
        model = load_model(model_dir, dtype=dtype, quantization=quantization).model
        runner = SimplePagedRunner(model, num_blocks=32)
        if dtype == "bfloat16" and cpu_kernels().has_bf16_linear:
            assert model.model.fused is not None
        if poison:

            def hook(module, args, out):
                out[args[0] == bad_token, 5] = value

            model.model.embed_tokens.register_forward_hook(hook)
        for seq in range(3):
            runner.add_sequence(seq)
        prompt = [10 + i for i in range(12)]
        prompt[9] = bad_token
        steps = [
            [(0, [5, 6, 7]), (1, prompt), (2, [8] * 18)],
            [(0, [9]), (1, [11]), (2, [12])],
        ]
        return [runner.step(chunks, all_logits=True) for chunks in steps]

    clean, bad = run(poison=False), run(poison=True)
    # rows: seq 0's 3, seq 1's 12 (the bad token at 9), seq 2's 18; then one each
    reached = [torch.zeros(33, dtype=torch.bool), torch.tensor([False, True, False])]
    reached[0][3 + 9 : 3 + 12] = True
    for out, clean_out, rows in zip(bad, clean, reached, strict=True):
        assert (~torch.isfinite(out[rows])).all(), "a bad hidden state gave finite logits"
        assert torch.isfinite(out[~rows]).all()
        assert same_bits(out[~rows], clean_out[~rows])


@pytest.mark.parametrize("cols", [1, 15, 64, 65, 1000, 49_152])  # lanes, 64-value chunks
def test_row_argmax_picks_the_index_torch_picks(kernels, cols):
    """Greedy tokens: the kernel's row argmax is torch's max(dim)'s index on every row,
    bit patterns that fast-math could mishandle included: the first NaN of a row that
    has one (NaN is maximal), +Inf, a row of -Inf (index 0), -0.0 against +0.0 (equal:
    the first), and many ties; rows strided, and enough of them to run on threads."""
    gen = torch.Generator().manual_seed(cols)
    rows = 70  # over PARALLEL_MIN_ROWS
    wide = torch.randint(-2, 3, (rows, cols + 9), generator=gen).float()
    x = wide[:, 4 : 4 + cols]  # rows strided by cols + 9
    last = cols - 1
    x[0, last] = float("nan")
    x[1, last // 2], x[1, last] = float("nan"), float("nan")
    x[2, last // 3], x[2, last] = float("inf"), float("inf")
    x[3] = float("-inf")
    x[4] = 0.0
    x[4, last] = -0.0
    x[5] = -0.0
    x[5, last] = 0.0
    x[6] = -1.0
    x[6, last] = 3.0  # the maximum alone at the end
    x[7, last], x[7, 0] = float("nan"), float("inf")
    expected = x.max(dim=-1).indices
    assert torch.equal(kernels.row_argmax(x), expected)
    assert torch.equal(kernels.row_argmax(x[:1]), expected[:1])
    assert expected[3] == 0 and expected[0] == last and expected[1] == last // 2
    assert kernels.row_argmax(x[:0]).shape == (0,)


def test_row_argmax_refuses_what_it_cannot_read(kernels):
    with pytest.raises(ValueError, match="float32"):
        kernels.row_argmax(torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="at least one column"):
        kernels.row_argmax(torch.zeros(2, 0))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.row_argmax(torch.zeros(3, 2).t())


@pytest.mark.parametrize("cols", [1, 15, 64, 65, 1000, 49_152])
def test_nonfinite_rows_finds_each_nan_and_plus_inf_row(kernels, cols):
    """The check before sampling: exactly the rows with a NaN (either sign, any payload)
    or +Inf, wherever in the row; not -Inf, -0.0, the largest finite values or a row
    whose sum overflows. The same rows as the torch path (the fallback off the CPU);
    rows strided, and enough of them to run on threads."""
    from engine.sample.sampler import nonfinite_rows

    gen = torch.Generator().manual_seed(cols)
    rows = 70  # over PARALLEL_MIN_ROWS
    wide = torch.randn(rows, cols + 9, generator=gen)
    x = wide[:, 4 : 4 + cols]  # rows strided by cols + 9
    last = cols - 1
    bits = x.view(torch.int32)
    x[0, last] = float("nan")
    x[1, last // 2] = float("inf")
    x[2] = float("-inf")  # probability 0 everywhere: not an error here
    bits[3, last // 3] = -0x400000  # a NaN with the sign bit set (0xFFC00000)
    bits[4, 0] = 0x7F800001  # a signalling NaN's bits
    x[5] = torch.finfo(torch.float32).max  # finite: its sum overflows to +Inf
    x[6, last] = -0.0
    x[7, last], x[7, 0] = float("-inf"), float("inf")
    expected = [0, 1, 3, 4, 7]
    assert kernels.nonfinite_rows(x) == expected
    assert nonfinite_rows(x) == expected  # the CPU path
    assert nonfinite_rows(x.to(torch.float64)) == expected  # the torch path
    assert kernels.nonfinite_rows(x[8:]) == []
    assert kernels.nonfinite_rows(x[:0]) == [] and kernels.nonfinite_rows(x[:, :0]) == []
