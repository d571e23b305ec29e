"""Attention backends and KV cache helpers against a naive per-sequence reference.

Every backend runs here in the dtypes it serves: the CPU rows everywhere, the CUDA rows
(marker ``gpu``; `bash scripts/gpu_check.sh`) where torch sees a GPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import (
    allocate_kv_caches,
    build_attention_metadata,
    get_attention_backend,
    kv_cache_bytes_per_block,
    set_attention_metadata,
)
from tests.engine.engine_helpers import GPU_ONLY, XFORMERS_ONLY

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 8, 4, 64


# (device, backend, dtype): every backend in the dtypes it serves; "fp32-bf16kv": float32
# rows over a bf16 cache (--kv-cache-dtype bfloat16)
F32_BF16KV = (torch.float32, torch.bfloat16)
BACKENDS = [
    pytest.param("cpu", "torch", torch.float32, id="cpu-torch-fp32"),
    pytest.param("cpu", "torch", torch.bfloat16, id="cpu-torch-bf16"),
    pytest.param("cpu", "cpu", torch.float32, id="cpu-cpu-fp32"),
    pytest.param("cuda", "torch", torch.float32, marks=GPU_ONLY, id="cuda-torch-fp32"),
    pytest.param("cuda", "torch", torch.bfloat16, marks=GPU_ONLY, id="cuda-torch-bf16"),
    pytest.param("cuda", "xformers", torch.bfloat16, marks=XFORMERS_ONLY, id="cuda-xformers-bf16"),
    pytest.param("cuda", "xformers", torch.float16, marks=XFORMERS_ONLY, id="cuda-xformers-fp16"),
    pytest.param("cpu", "torch", F32_BF16KV, id="cpu-torch-fp32-bf16kv"),
    pytest.param("cpu", "cpu", F32_BF16KV, id="cpu-cpu-fp32-bf16kv"),
    pytest.param("cuda", "torch", F32_BF16KV, marks=GPU_ONLY, id="cuda-torch-fp32-bf16kv"),
    pytest.param(
        "cuda", "xformers", F32_BF16KV, marks=XFORMERS_ONLY, id="cuda-xformers-fp32-bf16kv"
    ),
]


def _naive_attention(q, k, v, scale):
    """q [q_len, heads, hd], k/v [s_len, kv_heads, hd]: causal with offset, GQA by repeat."""
    q_len, s_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    query_pos = torch.arange(s_len - q_len, s_len)[:, None]
    scores = scores.masked_fill(torch.arange(s_len)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q_len, -1)


def _run_step(backend, cache, q_lens, s_lens, tables, history, dtype):
    """One packed step; history[i] holds sequence i's full (k, v) so far for the reference
    (fp32 on the CPU, of the values as rounded to the cache's dtype)."""
    n = sum(q_lens)
    device = cache.device
    q, k, v = (
        torch.randn(n, h, HEAD_DIM).to(device, dtype)
        for h in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS)
    )
    metadata = build_attention_metadata(q_lens, s_lens, tables, BLOCK_SIZE, device)
    with set_attention_metadata(metadata):
        out = backend.forward(q, k, v, cache, 0.3).float().cpu()
    q = q.float().cpu()
    k, v = (t.to(cache.dtype).float().cpu() for t in (k, v))  # as the cache holds them
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    start = 0
    for i, q_len in enumerate(q_lens):
        sl = slice(start, start + q_len)
        hk, hv = history[i]
        history[i] = (torch.cat([hk, k[sl]]), torch.cat([hv, v[sl]]))
        expected = _naive_attention(q[sl], *history[i], 0.3)
        torch.testing.assert_close(out[sl], expected, atol=tol, rtol=tol)
        start += q_len


@pytest.mark.parametrize(
    "steps",
    [
        [[7], [1], [1]],  # one sequence: prefill then decodes
        [[5, 9, 3], [1, 1, 1], [1, 1, 1]],  # batched decode, ragged contexts
        [[6, 2, 13], [4, 1, 3], [1, 5, 1]],  # mixed prefill chunks, decodes, 1+k queries
        [[16], [3], [1]],  # exact block boundary, then a partial chunk
        # the cpu backend's split: queries over 16 tokens go to SDPA, the rest to the kernel
        [[20, 3, 33], [1, 18, 2], [17, 1, 1]],
    ],
)
@pytest.mark.parametrize(("device", "backend_name", "dtype"), BACKENDS)
def test_backend_matches_naive(steps, device, backend_name, dtype):
    torch.manual_seed(0)
    dtype, kv_dtype = dtype if isinstance(dtype, tuple) else (dtype, dtype)
    backend = get_attention_backend(backend_name, device)
    cache = allocate_kv_caches(1, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, kv_dtype, device)[
        0
    ]
    free = list(range(1, NUM_BLOCKS))
    random.Random(0).shuffle(free)
    num_seqs = len(steps[0])
    tables, s_lens = [[] for _ in range(num_seqs)], [0] * num_seqs
    history = [(torch.empty(0, NUM_KV_HEADS, HEAD_DIM),) * 2 for _ in range(num_seqs)]
    for q_lens in steps:
        for i, q_len in enumerate(q_lens):
            s_lens[i] += q_len
            while len(tables[i]) * BLOCK_SIZE < s_lens[i]:
                tables[i].append(free.pop())
        _run_step(backend, cache, q_lens, list(s_lens), [list(t) for t in tables], history, dtype)


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_padding_slots_are_never_written(backend_name):
    backend = get_attention_backend(backend_name, "cpu")
    cache = allocate_kv_caches(1, 4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32, "cpu")[0]
    metadata = build_attention_metadata([2], [2], [[3]], BLOCK_SIZE)
    metadata.slot_mapping[1] = -1
    q, k = torch.randn(2, NUM_HEADS, HEAD_DIM), torch.ones(2, NUM_KV_HEADS, HEAD_DIM)
    with set_attention_metadata(metadata):
        backend.forward(q, k, k, cache, 1.0)
    assert cache[:, 3, 0].eq(1).all()
    assert cache[:, 3, 1:].eq(0).all() and cache[:, :3].eq(0).all()


def test_kv_cache_allocation_and_size():
    caches = allocate_kv_caches(3, 5, 16, 2, 8, torch.float32, "cpu")
    assert len(caches) == 3 and caches[0].shape == (2, 5, 16, 2, 8)
    assert caches[1].data_ptr() - caches[0].data_ptr() == 2 * 5 * 16 * 2 * 8 * 4
    assert kv_cache_bytes_per_block(3, 16, 2, 8, torch.bfloat16) == 3 * 2 * 16 * 2 * 8 * 2
    with pytest.raises(ValueError, match="num_blocks"):
        allocate_kv_caches(1, 1, 16, 2, 8, torch.float32, "cpu")


def test_metadata_rejects_inconsistent_lengths():
    with pytest.raises(ValueError, match="query_len"):
        build_attention_metadata([5], [3], [[1]], 4)
    with pytest.raises(ValueError, match="block_size"):
        build_attention_metadata([3], [9], [[1, 2]], 4)


def test_xformers_backend_refused_on_cpu():
    with pytest.raises(RuntimeError, match=r"needs a CUDA GPU and the xformers package"):
        get_attention_backend("xformers", "cpu")
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash", "cpu")


def _fake_fmha(forward):
    """An object shaped like ``xformers.ops.fmha`` whose attention call is ``forward``."""
    from types import SimpleNamespace

    seen = {}

    class Mask:
        @staticmethod
        def from_seqlens(**kwargs):
            seen["seqlens"] = kwargs
            return SimpleNamespace(to=lambda device: ("mask", device))

    attn_bias = SimpleNamespace(BlockDiagonalCausalWithOffsetPaddedKeysMask=Mask)
    return SimpleNamespace(attn_bias=attn_bias, memory_efficient_attention_forward=forward), seen


def test_xformers_probe_reports_a_build_that_cannot_run():
    """An xformers wheel built for another torch imports, then fails at its first call
    with a many-line 'No operator found' (seen on the H200 with xformers 0.0.35 and torch
    2.11): the probe turns it into one line, so auto falls back to torch and an explicit
    --attn-backend xformers fails with that line instead of at the first request."""
    from engine.attention import probe_fmha, xformers_problem

    def broken(q, k, v, attn_bias):
        raise NotImplementedError(
            "No operator found for `memory_efficient_attention_forward` with inputs:\n"
            "     query : shape=(1, 2, 1, 2, 64)\n`cutlassF-pt` is not supported because:"
        )

    fmha, _ = _fake_fmha(broken)
    problem = probe_fmha(fmha, torch.device("cpu"), torch.bfloat16)
    assert problem == "No operator found for `memory_efficient_attention_forward` with inputs:"

    calls = []
    fmha, seen = _fake_fmha(lambda q, k, v, attn_bias: calls.append((q.shape, k.shape, attn_bias)))
    assert probe_fmha(fmha, torch.device("cpu"), torch.float16) is None
    ((q_shape, k_shape, bias),) = calls
    assert bias == ("mask", torch.device("cpu"))
    assert seen["seqlens"] == {"q_seqlen": [1, 1], "kv_padding": 8, "kv_seqlen": [3, 5]}
    assert q_shape[1] == 2 and k_shape[1] == 16  # two queries, two padded 8-key ranges

    assert xformers_problem("cpu") == "needs a CUDA GPU"


def test_explicit_xformers_that_cannot_run_is_one_clear_error(monkeypatch, caplog):
    from engine import loader

    reason = "xformers 0.0.35 cannot run torch.bfloat16 attention here: No operator found"
    monkeypatch.setattr(loader, "xformers_problem", lambda device, dtype: reason)
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=r"^attn_backend 'xformers': xformers 0\.0\.35 .*'torch'$"):
        loader.resolve_attn_backend("xformers", cuda, torch.bfloat16)
    loader._warn_once.cache_clear()
    with caplog.at_level("WARNING", logger="engine.loader"):
        for _ in range(3):  # the target, its draft, a second engine: one warning
            assert loader.resolve_attn_backend("auto", cuda, torch.bfloat16) == "torch"
    warnings = [r.getMessage() for r in caplog.records if "cannot run" in r.getMessage()]
    assert warnings == [f"{reason}; attention runs on the torch backend (SDPA)"]
    monkeypatch.setattr(loader, "xformers_problem", lambda device, dtype: None)
    assert loader.resolve_attn_backend("auto", cuda, torch.bfloat16) == "xformers"
    # not installed at all (a plain CUDA install): torch, and nothing to warn about
    missing = f"{loader.XFORMERS_NOT_INSTALLED} (pip install 'specserve[gpu]'): no module"
    monkeypatch.setattr(loader, "xformers_problem", lambda device, dtype: missing)
    caplog.clear()
    with caplog.at_level("WARNING", logger="engine.loader"):
        assert loader.resolve_attn_backend("auto", cuda, torch.bfloat16) == "torch"
    assert not caplog.records


def test_cpu_backend_needs_its_kernels():
    from engine.kernels.cpu import cpu_kernels_enabled

    with cpu_kernels_enabled(False), pytest.raises(RuntimeError, match="use --attn-backend torch"):
        get_attention_backend("cpu", "cpu")


def test_the_attn_backend_help_says_what_auto_picks():
    """auto takes the compiled kernels on CPU in bfloat16 as in float32 (the help once
    said float32 only), and without them torch (docs/architecture.md, "Attention
    backends")."""
    from engine.entrypoints.cli import build_parser, iter_parsers
    from engine.kernels.cpu import cpu_kernels_enabled
    from engine.loader import resolve_attn_backend

    helps = {
        p.prog: a.help
        for p in iter_parsers(build_parser())
        for a in p._actions
        if "--attn-backend" in a.option_strings
    }
    assert "specserve serve" in helps
    for prog, text in helps.items():
        assert "on CPU in float32 or bfloat16 when they build, else torch" in text, prog
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        assert resolve_attn_backend("auto", cpu, dtype) == "cpu"
        with cpu_kernels_enabled(False):
            assert resolve_attn_backend("auto", cpu, dtype) == "torch"


def test_metadata_is_per_thread_and_refuses_nesting():
    """Two engines in one process run forwards on their own threads at the same time;
    on one thread a nested forward is a bug."""
    import threading

    from engine.attention import get_attention_metadata

    meta = [build_attention_metadata([1], [1], [[1]], 16) for _ in range(2)]
    inside, seen, errors = threading.Barrier(2), [None, None], []

    def forward(i: int) -> None:
        try:
            with set_attention_metadata(meta[i]):
                inside.wait(timeout=10)  # both threads are inside at once
                seen[i] = get_attention_metadata()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=forward, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and seen[0] is meta[0] and seen[1] is meta[1]
    nested = pytest.raises(RuntimeError, match="cannot nest")
    with set_attention_metadata(meta[0]), nested, set_attention_metadata(meta[1]):
        pass
    with pytest.raises(RuntimeError, match="no attention metadata set"):
        get_attention_metadata()
