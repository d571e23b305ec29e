"""The same end-to-end checks on every device and attention backend this machine has.

On a CPU-only machine (CI) the CPU rows run and the CUDA rows are skipped for want of a
GPU; on a CUDA machine (`bash scripts/gpu_check.sh`, or `pytest -m gpu`) the CUDA rows
run the very same code: attention backends against a naive reference, greedy engine
output against transformers, n-gram speculation against plain decoding, and the
rejection sampler's seeded draws on the device.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import (
    allocate_kv_caches,
    build_attention_metadata,
    get_attention_backend,
    set_attention_metadata,
)
from tests.engine.engine_helpers import (
    assert_all_blocks_released,
    greedy,
    hf_greedy,
    make_engine,
    prompts_of_lengths,
    run_to_completion,
)
from tests.engine.test_attention import _naive_attention

HAS_CUDA = torch.cuda.is_available()


def _xformers_ok() -> bool:
    try:
        import xformers.ops  # noqa: F401
    except ImportError:
        return False
    return HAS_CUDA


_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU on this machine")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", marks=[pytest.mark.gpu, _cuda])]
_gpu = [pytest.mark.gpu, _cuda]
_xformers = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _xformers_ok(), reason="needs CUDA and xformers"),
]
# (device, backend, dtype): every backend in the dtypes it serves
BACKENDS = [
    pytest.param("cpu", "torch", torch.float32, id="cpu-torch-fp32"),
    pytest.param("cpu", "torch", torch.bfloat16, id="cpu-torch-bf16"),
    pytest.param("cpu", "cpu", torch.float32, id="cpu-cpu-fp32"),
    pytest.param("cuda", "torch", torch.float32, marks=_gpu, id="cuda-torch-fp32"),
    pytest.param("cuda", "torch", torch.bfloat16, marks=_gpu, id="cuda-torch-bf16"),
    pytest.param("cuda", "xformers", torch.bfloat16, marks=_xformers, id="cuda-xformers-bf16"),
    pytest.param("cuda", "xformers", torch.float16, marks=_xformers, id="cuda-xformers-fp16"),
]


@pytest.fixture(autouse=True)
def _exact_fp32_matmuls():
    """TF32 would make CUDA fp32 greedy comparisons meaningless."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize(("device", "backend_name", "dtype"), BACKENDS)
def test_attention_backend_matches_naive(device, backend_name, dtype):
    heads, kv_heads, head_dim, block_size, num_blocks = 8, 2, 64, 16, 48
    backend = get_attention_backend(backend_name, device)
    cache = allocate_kv_caches(1, num_blocks, block_size, kv_heads, head_dim, dtype, device)[0]
    free = list(range(1, num_blocks))
    random.Random(0).shuffle(free)
    # prefill chunks (some over 16 tokens), decodes, 1 + k verification queries
    steps = [[20, 3, 33, 7], [1, 18, 2, 5], [17, 1, 1, 1], [1, 1, 1, 1]]
    tables: list[list[int]] = [[] for _ in steps[0]]
    s_lens = [0] * len(steps[0])
    history = [None] * len(steps[0])
    gen = torch.Generator().manual_seed(0)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for q_lens in steps:
        for i, q in enumerate(q_lens):
            s_lens[i] += q
            while len(tables[i]) * block_size < s_lens[i]:
                tables[i].append(free.pop())
        n = sum(q_lens)
        q, k, v = (
            torch.randn(n, h, head_dim, generator=gen).to(device, dtype)
            for h in (heads, kv_heads, kv_heads)
        )
        metadata = build_attention_metadata(
            q_lens, list(s_lens), [list(t) for t in tables], block_size, device
        )
        with set_attention_metadata(metadata):
            out = backend.forward(q, k, v, cache, head_dim**-0.5)
        start = 0
        for i, q_len in enumerate(q_lens):
            sl = slice(start, start + q_len)
            hk, hv = history[i] or (k[:0], v[:0])
            history[i] = (torch.cat([hk, k[sl]]), torch.cat([hv, v[sl]]))
            expected = _naive_attention(
                q[sl].float().cpu(), *(t.float().cpu() for t in history[i]), head_dim**-0.5
            )
            torch.testing.assert_close(out[sl].float().cpu(), expected, atol=tol, rtol=tol)
            start += q_len


@pytest.mark.parametrize("device", DEVICES)
def test_engine_greedy_matches_transformers(tiny_model_dir, device):
    """fp32 on the device, continuous batching with staggered arrivals, against
    transformers' greedy generate() on the CPU."""
    engine = make_engine(tiny_model_dir, device=device, dtype="float32")
    prompts = prompts_of_lengths([3, 17, 9, 30], seed=5)
    arrivals = {2 * i: [(f"d{i}", p, greedy(10))] for i, p in enumerate(prompts)}
    results = run_to_completion(engine, arrivals)
    for i, prompt in enumerate(prompts):
        assert results[f"d{i}"]["token_ids"] == hf_greedy(tiny_model_dir, prompt, 10)
    assert_all_blocks_released(engine)


@pytest.mark.parametrize("device", DEVICES)
def test_ngram_speculation_equals_plain_decoding(tiny_model_dir, device):
    prompts = prompts_of_lengths([12, 25], seed=9)
    prompts.append(prompts[0][:6] * 5)  # repetitive: n-gram drafts get accepted
    work = {0: [(f"s{i}", p, greedy(16)) for i, p in enumerate(prompts)]}
    plain = run_to_completion(make_engine(tiny_model_dir, device=device, dtype="float32"), work)
    engine = make_engine(
        tiny_model_dir,
        device=device,
        dtype="float32",
        speculative_method="ngram",
        speculative_disable_batch_size=64,
    )
    spec = run_to_completion(engine, work)
    for request_id, ref in plain.items():
        assert spec[request_id]["token_ids"] == ref["token_ids"], request_id
    assert engine.stats.num_draft_tokens > 0
    assert_all_blocks_released(engine)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_is_reproducible_on_the_device(tiny_model_dir, device):
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=123, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = make_engine(tiny_model_dir, device=device, dtype="float32")
        runs.append(run_to_completion(engine, {0: [("x", [5, 6, 7, 8], params)]}))
    assert runs[0]["x"]["token_ids"] == runs[1]["x"]["token_ids"]
    assert len(runs[0]["x"]["token_ids"]) == 12
