"""Parity of our paged Llama-family model with transformers on tiny random checkpoints.

Every model is loaded through the real loader from a saved HF directory; the reference is
``AutoModelForCausalLM.from_pretrained`` on the same directory. The paged cache is driven
by SimplePagedRunner, whose shuffled free list makes every block table non-contiguous.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.loader import load_model
from engine.models import get_model_class
from tests.engine.simple_runner import SimplePagedRunner

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CONFIGS = {
    "llama-gqa": ("llama", {}),
    "qwen2-bias-tied": ("qwen2", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {"num_hidden_layers": 3}),
    "llama-tied-llama3-rope": (
        "llama",
        {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE},
    ),
    "llama-mha-linear-rope": (
        "llama",
        {
            "num_key_value_heads": 4,
            "rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0},
        },
    ),
}


# Two implementations of the same model on CPU fp32: specserve's compiled kernels
# (paged attention, norm, rotary, SiLU; the default) and plain torch ops with the
# gather + SDPA attention backend (SPECSERVE_CPU_KERNELS=0, the path every other
# device and dtype takes).
IMPLEMENTATIONS = {"kernels": "cpu", "torch": "torch"}


@pytest.fixture(
    scope="module",
    params=[(c, i) for c in CONFIGS for i in IMPLEMENTATIONS],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def _loaded(request, tiny_model_factory):
    from transformers import AutoModelForCausalLM

    config_name, impl = request.param
    arch, overrides = CONFIGS[config_name]
    path = tiny_model_factory(arch=arch, **overrides)
    loaded = load_model(path, dtype="float32", device="cpu", attn_backend=IMPLEMENTATIONS[impl])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return loaded.model, hf, impl


@pytest.fixture
def models(_loaded):
    """(our model, transformers' model), with the kernels switched on or off for the
    duration of the test (norm, rotary and SiLU look them up at every call)."""
    from engine.kernels.cpu import cpu_kernels_enabled

    model, hf, impl = _loaded
    with cpu_kernels_enabled(impl == "kernels"):
        yield model, hf


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


@torch.no_grad()
def _hf_logits(hf, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    return hf(torch.tensor([ids])).logits[0].float()


def _assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    # fp32: 1e-4 of the logit scale (max |logit| ~ 5 on these models).
    atol = 1e-4 * max(1.0, ref.abs().max().item())
    torch.testing.assert_close(ours, ref, atol=atol, rtol=0)


@pytest.mark.parametrize("prompt_len", [1, 15, 16, 17, 33, 50])
def test_prefill_logits_match(models, prompt_len):
    model, hf = models
    runner = SimplePagedRunner(model, num_blocks=32, block_size=16, seed=prompt_len)
    runner.add_sequence(0)
    ids = _tokens(prompt_len, seed=prompt_len)
    _assert_logits_close(runner.step([(0, ids)], all_logits=True), _hf_logits(hf, ids))


def test_every_decode_step_matches(models):
    model, hf = models
    runner = SimplePagedRunner(model, num_blocks=32, block_size=4, seed=1)
    ids = _tokens(9, seed=2)
    runner.add_sequence(0)
    step_logits = [runner.step([(0, ids)])[0]]
    for token in _tokens(30, seed=3):  # 30 decodes crossing many 4-token blocks
        ids.append(token)
        step_logits.append(runner.step([(0, [token])])[0])
    ref = _hf_logits(hf, ids)[8:]  # logits after the prompt, then after each decode
    _assert_logits_close(torch.stack(step_logits), ref)


def test_mixed_packed_batch_matches(models):
    """Prefill chunk, two decodes, one 1+3 verification query and a continued prefill."""
    model, hf = models
    runner = SimplePagedRunner(model, num_blocks=64, block_size=4, seed=5)
    seqs = {i: _tokens(n, seed=10 + i) for i, n in enumerate([20, 13, 30, 21, 27])}
    # Step 1 builds context: sequences 1-4 get all but their last tokens (3 with 16 of 27).
    history = {1: 12, 2: 29, 3: 17, 4: 16}
    for seq_id in seqs:
        runner.add_sequence(seq_id)
    runner.step([(i, seqs[i][:n]) for i, n in history.items()])
    # Step 2, packed: | prefill 20 | decode | decode | verify 1+3 | prefill chunk 11 |
    chunks = [(0, seqs[0])] + [(i, seqs[i][n:]) for i, n in history.items()]
    logits = runner.step(chunks, all_logits=True)
    start = 0
    for seq_id, new_tokens in chunks:
        end = start + len(new_tokens)
        ref = _hf_logits(hf, seqs[seq_id])[-len(new_tokens) :]
        _assert_logits_close(logits[start:end], ref)
        start = end


@torch.no_grad()
def _hf_greedy(hf, ids: list[int], new_tokens: int) -> list[int]:
    out = hf.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=new_tokens,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def _assert_same_greedy(ours: list[list[int]], expected: list[list[int]]) -> None:
    # HF stops after an EOS token; our driver runs on, so compare up to HF's stop.
    assert [o[: len(e)] for o, e in zip(ours, expected, strict=True)] == expected


def test_greedy_generation_matches_hf(models):
    model, hf = models
    prompts = [_tokens(n, seed=20 + n) for n in (3, 9, 17, 30)]
    expected = [_hf_greedy(hf, p, 12) for p in prompts]
    runner = SimplePagedRunner(model, num_blocks=64, block_size=4, seed=7)
    _assert_same_greedy(runner.generate_greedy(prompts[:1], 12), expected[:1])  # single
    _assert_same_greedy(runner.generate_greedy(prompts, 12), expected)  # ragged batch


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        get_model_class(["GPT2LMHeadModel"])


@pytest.mark.slow
def test_default_model_greedy_matches_transformers():
    from transformers import AutoModelForCausalLM

    # the dequantized GGUF: transformers dequantizes it the same way
    loaded = load_model(None, dtype="float32", device="cpu", quantization="none")
    assert loaded.model.model.layers[0].self_attn.attn_backend.name == "cpu"
    hf = AutoModelForCausalLM.from_pretrained(loaded.model_dir, dtype=torch.float32).eval()
    messages = [[{"role": "user", "content": "What is the capital of France?"}],
                [{"role": "user", "content": "Name three colors."}]]  # fmt: skip
    prompts = [
        list(loaded.tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=False))
        for m in messages
    ]
    expected = [_hf_greedy(hf, p, 16) for p in prompts]
    ours = SimplePagedRunner(loaded.model, num_blocks=64).generate_greedy(prompts, 16)
    _assert_same_greedy(ours, expected)
    assert "Paris" in loaded.tokenizer.decode(ours[0])


def test_cpu_weight_packing_matches_plain_linear(tiny_model_dir):
    """PackedLinear (specserve's float32 Linear kernel where the build has FMA, else
    oneDNN-prepacked weights) equals F.linear on the checkpoint's weights, for the row
    counts of decode, verification and prefill."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from engine.models.weights import PackedLinear

    loaded = load_model(tiny_model_dir, device="cpu", dtype="float32")
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    if not isinstance(qkv, PackedLinear):
        pytest.skip("oneDNN weight packing is not available on this CPU build")
    attn = AutoModelForCausalLM.from_pretrained(tiny_model_dir).model.layers[0].self_attn
    weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    for rows in (1, 5, 9, 32, 33):  # 9 and 33 are padded to a bucket, then trimmed
        x = torch.randn(rows, qkv.in_features)
        torch.testing.assert_close(qkv(x), F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_bf16_linear_layers_run_on_the_kernel_and_rows_are_independent(tiny_model_dir):
    """bf16 on a CPU with AVX512-BF16: every Linear layer runs the bf16 Linear kernel,
    gives what F.linear gives up to bf16 rounding, and a row's bits do not depend on the
    rows computed with it (decode, verification and prefill row counts)."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from engine.models.weights import PackedLinear, linear_kernels

    if linear_kernels(torch.zeros(1, 1, dtype=torch.bfloat16)) is None:
        pytest.skip("no AVX512-BF16 here: bf16 Linear layers run on oneDNN")
    loaded = load_model(tiny_model_dir, device="cpu", dtype="bfloat16")
    linears = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 4 * len(loaded.model.model.layers) + 1
    assert all(m.kernels is not None for m in linears)
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    attn = AutoModelForCausalLM.from_pretrained(tiny_model_dir).model.layers[0].self_attn
    weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    weight = weight.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(33, qkv.in_features, generator=gen).to(torch.bfloat16)
    whole = qkv(x)
    torch.testing.assert_close(whole.float(), F.linear(x, weight).float(), rtol=8e-3, atol=1e-3)
    for rows in (1, 5, 9, 32):
        assert torch.equal(qkv(x[:rows]).view(torch.int16), whole[:rows].view(torch.int16))


def test_row_buckets_are_few_and_waste_under_a_quarter():
    from engine.models.weights import row_bucket

    sizes = {row_bucket(rows) for rows in range(1, 4097)}
    assert len(sizes) <= 48
    for rows in range(1, 4097):
        assert rows <= row_bucket(rows) < 1.25 * rows
    assert all(row_bucket(rows) == rows for rows in range(1, 8))
