"""--kv-cache-dtype bfloat16: a float32 model over a bf16 KV cache.

The option is refused with one line naming the field where it cannot apply; the cache
is allocated in bf16 and sized at half the bytes a block (twice the blocks for one
memory budget); the compiled kernels (the one-call decoder and the layer-by-layer
forward) and the torch backend compute the same model over it, within fp32 rounding;
the engine serves what the model computes over that cache, says so in its model info
(the gRPC ModelInfo, vLLM's GetServerInfo) and salts its prefix cache with it; the
offline API (LLM) takes the option. The
speculation matrices (tests/engine/test_stress.py, test_lossless_sampling.py) cover it
beside every proposer."""

from __future__ import annotations

import argparse

import pytest
import torch

from engine.attention import (
    allocate_kv_caches,
    build_attention_metadata,
    get_attention_backend,
    set_attention_metadata,
)
from engine.config import EngineConfig
from engine.core.kv_sizing import plan_kv_cache
from engine.entrypoints.args import add_engine_args, engine_config_from_args
from engine.io.sampling_params import SamplingParams
from engine.loader import load_model, resolve_kv_cache_dtype
from engine.server import convert, vllm_convert
from tests.engine.engine_helpers import make_engine, run_to_completion
from tests.engine.simple_runner import SimplePagedRunner


def test_the_option_is_refused_where_it_cannot_apply():
    with pytest.raises(
        ValueError, match="kv_cache_dtype must be one of 'auto', 'bfloat16', got 'fp8'"
    ):
        EngineConfig(kv_cache_dtype="fp8")
    assert resolve_kv_cache_dtype("auto", torch.float16) is torch.float16
    assert resolve_kv_cache_dtype("bfloat16", torch.float32) is torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16) is torch.bfloat16
    with pytest.raises(
        ValueError, match="'bfloat16' needs a float32 or bfloat16 model, got float16"
    ):
        resolve_kv_cache_dtype("bfloat16", torch.float16)


def test_the_flag_reaches_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).kv_cache_dtype == "auto"
    args = parser.parse_args(["--kv-cache-dtype", "bfloat16"])
    assert engine_config_from_args(args).kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "float16"])


def test_a_bf16_cache_holds_twice_the_blocks(tiny_model_dir):
    loaded = load_model(tiny_model_dir, dtype="float32", device="cpu")
    budget = dict(kv_cache_memory_gib=0.01, max_model_len=64)
    fp32 = plan_kv_cache(EngineConfig(**budget), loaded)
    bf16 = plan_kv_cache(EngineConfig(kv_cache_dtype="bfloat16", **budget), loaded)
    assert bf16.bytes_per_block * 2 == fp32.bytes_per_block
    assert bf16.num_blocks in (2 * fp32.num_blocks, 2 * fp32.num_blocks + 1)


@pytest.mark.parametrize("checkpoint", ["gguf", "fp32"])
def test_the_kernels_and_the_torch_backend_compute_the_same_model(
    tiny_model_dir, tiny_gguf_path, checkpoint
):
    """The same float32 model over a bf16 cache: the compiled kernels (one call) and
    the torch backend (K/V rounded by torch when written, widened before SDPA) agree
    to fp32 rounding, far closer than either is to the model over an fp32 cache."""
    path = tiny_gguf_path if checkpoint == "gguf" else tiny_model_dir
    logits = {}
    prompts = {0: list(range(30, 70)), 1: [5, 6, 7]}
    for backend, kv in (("cpu", torch.bfloat16), ("torch", torch.bfloat16), ("cpu", None)):
        model = load_model(path, dtype="float32", device="cpu", attn_backend=backend).model
        runner = SimplePagedRunner(model, num_blocks=32, kv_dtype=kv)
        assert model.model.layers[0].self_attn.kv_cache.dtype is (kv or torch.float32)
        for seq_id in prompts:
            runner.add_sequence(seq_id)
        steps = [runner.step(list(prompts.items()), all_logits=True)]
        for token in (9, 200, 13):  # decodes after the prefill, both sequences
            steps.append(runner.step([(0, [token]), (1, [token + 1])], all_logits=True))
        logits[backend, kv] = torch.cat(steps)
    kernels, torch_path = logits["cpu", torch.bfloat16], logits["torch", torch.bfloat16]
    fp32_cache = logits["cpu", None]
    near = float((kernels - torch_path).norm() / torch_path.norm())
    far = float((kernels - fp32_cache).norm() / fp32_cache.norm())
    assert near < 1e-4 and far > 10 * near, (near, far)


def test_the_engine_serves_the_model_over_its_bf16_cache(tiny_model_dir):
    engine = make_engine(tiny_model_dir, kv_cache_dtype="bfloat16", num_kv_blocks=64)
    assert all(cache.dtype is torch.bfloat16 for cache in engine.runner.kv_caches)
    plain = make_engine(tiny_model_dir, num_kv_blocks=64)
    assert plain.runner.kv_caches[0].dtype is torch.float32
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = run_to_completion(engine, {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]})
    model = load_model(tiny_model_dir, dtype="float32", device="cpu").model
    expected = SimplePagedRunner(model, num_blocks=64, kv_dtype=torch.bfloat16).generate_greedy(
        prompts, 12
    )
    assert [results[f"r{i}"]["token_ids"] for i in range(2)] == expected
    info = engine.model_info()
    assert (info["dtype"], info["kv_cache_dtype"]) == ("float32", "bfloat16")
    assert convert.to_model_info(info).kv_cache_dtype == "bfloat16"
    assert vllm_convert.server_info(info, 0, 0.0, 0.0).kv_cache_dtype == "bfloat16"
    plain_info = plain.model_info()
    assert convert.to_model_info(plain_info).kv_cache_dtype == "float32"
    assert vllm_convert.server_info(plain_info, 0, 0.0, 0.0).kv_cache_dtype == "auto"
    # a prefix cached over fp32 K/V is not a prefix cached over bf16 K/V
    assert engine.kv_manager.cache_key != plain.kv_manager.cache_key


def test_the_torch_backend_rounds_what_it_writes_and_widens_what_it_reads():
    """fp32 queries over a bf16 cache: K/V stored as torch rounds them (to nearest
    even), attention equal to fp32 attention over those rounded K/V, and near the
    fp32 cache's result."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size = 4, 2, 8, 4
    q_len, tables = 7, [[3, 1]]
    q = torch.randn(q_len, heads, head_dim)
    k, v = torch.randn(q_len, kv_heads, head_dim), torch.randn(q_len, kv_heads, head_dim)
    backend = get_attention_backend("torch", "cpu")
    out = {}
    for kv in (torch.bfloat16, torch.float32):
        cache = allocate_kv_caches(1, 4, block_size, kv_heads, head_dim, kv, "cpu")[0]
        metadata = build_attention_metadata([q_len], [q_len], tables, block_size)
        with set_attention_metadata(metadata):
            out[kv] = backend.forward(q, k, v, cache, 0.3)
        assert out[kv].dtype is torch.float32
        stored = cache[:, [3, 1]].reshape(2, -1, kv_heads, head_dim)[:, :q_len]
        assert torch.equal(stored[0], k.to(kv)) and torch.equal(stored[1], v.to(kv))
    rounded = [t.to(torch.bfloat16).float() for t in (k, v)]
    expected = _causal_attention(q, *rounded, 0.3)
    torch.testing.assert_close(out[torch.bfloat16], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[torch.float32], _causal_attention(q, k, v, 0.3))
    torch.testing.assert_close(out[torch.bfloat16], out[torch.float32], atol=2e-2, rtol=0)
    assert not torch.equal(out[torch.bfloat16], out[torch.float32])


def _causal_attention(q, k, v, scale):
    """[q_len, heads * head_dim] fp32: causal attention of one sequence, K/V heads
    shared by groups of query heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(torch.ones_like(scores[0]).triu(1).bool(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def test_the_offline_api_takes_the_option(tiny_model_dir):
    """LLM(..., dtype="float32", kv_cache_dtype="bfloat16"): bf16 caches under the fp32
    model, and greedy generation over them repeats itself exactly."""
    from engine.entrypoints.llm import LLM

    prompts = [[5, 6, 7, 8, 9], list(range(20, 60))]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(
            model=tiny_model_dir,
            device="cpu",
            dtype="float32",
            kv_cache_dtype="bfloat16",
            attn_backend="torch",
            num_kv_blocks=64,
        )
        assert llm.config.kv_cache_dtype == "bfloat16"
        assert llm.engine.loaded.dtype is torch.float32
        assert all(cache.dtype is torch.bfloat16 for cache in llm.engine.runner.kv_caches)
        runs.append([out.token_ids for out in llm.generate(prompts, params)])
    assert runs[0] == runs[1] and all(len(ids) == 10 for ids in runs[0])
