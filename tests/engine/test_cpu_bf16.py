"""bfloat16 on CPU through the real engine: the compiled kernels against torch ops.

Two engines on the same tiny bf16 checkpoint and the same requests: one with the
kernels (the `cpu` attention backend, norm / rotary / SiLU kernels), one with
``cpu_kernels_enabled(False)`` (torch ops, the `torch` backend). Each step's batch is the
same in both, so their logits can be compared step by step.

They are not bit-identical: the norm, rotary and SiLU kernels round like torch's bf16
ops (tests/engine/test_cpu_kernels.py), but attention is not. The kernel keeps the
softmax and P.V in fp32 and rounds its output once; torch's SDPA rounds the
probabilities to bf16 before P.V. Each layer's attention output then differs by about
a bf16 ulp in some elements, which the next layers carry on. The logits stay within
LOGIT_TOL of the logit scale (measured: at most 2.0% on these models; a real bug, such
as an unrounded norm, a wrong cos/sin table or a misread cache, moves them by tens of
percent) for as long as both runs have fed a request the same tokens. Where the torch
path's top two logits are closer than that, greedy decoding can pick differently and
the runs go separate ways from there: a random tiny model has such near-ties (the
40-token prompt of llama-gqa-hd16 meets one, a single bf16 ulp, at its second decode
step). So logits are compared per request up to the step where its tokens diverge,
and a divergence must be at such a near-tie. What must not depend on the path or the
batch is the engine's own output with and without speculation: tests/engine/
test_spec_decode.py checks that in bf16 (there one kernel computes every query row).
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import cpu_kernels_enabled
from tests.engine.engine_helpers import greedy, make_engine, prompts_of_lengths, run_to_completion

# |kernels - torch ops| <= LOGIT_TOL * max |logit| (bf16 has 8 significant bits: ~0.4%
# per rounding; a few roundings apart per layer).
LOGIT_TOL = 0.05

MODELS = {
    "llama-gqa-hd16": ("llama", {}),
    "llama-hd64": ("llama", {"head_dim": 64, "num_attention_heads": 2, "num_key_value_heads": 1}),
    "qwen2-bias-tied": ("qwen2", {"tie_word_embeddings": True}),
}
# decode-only (short), prompts over fp32's 16-token kernel limit (bf16 has no limit)
PROMPT_LENGTHS = [3, 9, 17, 40]


def _run(model_dir: str, kernels: bool, max_tokens: int) -> tuple[list[torch.Tensor], dict]:
    """(each step's logits, results) of greedy decoding of PROMPT_LENGTHS prompts."""
    with cpu_kernels_enabled(kernels):
        engine = make_engine(model_dir, dtype="bfloat16", attn_backend="auto")
        backend = engine.runner.model.model.layers[0].self_attn.attn_backend
        assert backend.name == ("cpu" if kernels else "torch")
        logits: list[torch.Tensor] = []
        execute = engine.runner.execute

        def recording(prepared):
            out = execute(prepared)
            logits.append(out.clone())
            return out

        engine.runner.execute = recording
        prompts = prompts_of_lengths(PROMPT_LENGTHS, seed=3)
        requests = [(str(i), p, greedy(max_tokens)) for i, p in enumerate(prompts)]
        results = run_to_completion(engine, {0: requests})
    return logits, results


@pytest.fixture(scope="module", params=list(MODELS), ids=list(MODELS))
def both(request, tiny_model_factory):
    arch, overrides = MODELS[request.param]
    model_dir = tiny_model_factory(arch=arch, **overrides)
    return _run(model_dir, True, 12), _run(model_dir, False, 12)


def test_bf16_uses_the_kernels(tiny_model_dir):
    """A bf16 model on CPU gets the kernel attention backend and bf16 caches."""
    engine = make_engine(tiny_model_dir, dtype="bfloat16", attn_backend="auto")
    attn = engine.runner.model.model.layers[0].self_attn
    assert attn.attn_backend.name == "cpu" and attn.kv_cache.dtype == torch.bfloat16


def test_logits_match_torch_ops_every_step(both):
    """Each request's logits, step by step, while both engines have fed it the same
    tokens. The two paths may pick different tokens only where the torch path's top two
    logits are within the tolerance (a near-tie an ulp can flip); from there on the
    request's inputs differ and it is no longer compared."""
    (ours, _), (ref, _) = both
    assert len(ours) == len(ref) > 10  # prefill, then decode steps
    diverged: set[int] = set()
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a.shape == b.shape and torch.isfinite(a).all()
        for row in sorted(set(range(b.shape[0])) - diverged):
            scale = b[row].abs().max().item()
            err = (a[row] - b[row]).abs().max().item()
            assert err <= LOGIT_TOL * scale, f"step {step} row {row}: |diff| {err:.4f}"
            if a[row].argmax() != b[row].argmax():
                margin = _margin(b[row : row + 1]).item()
                assert margin <= LOGIT_TOL * scale, f"step {step} row {row}: margin {margin}"
                diverged.add(row)
    assert len(diverged) < len(PROMPT_LENGTHS)  # most requests agree all the way


def _margin(logits: torch.Tensor) -> torch.Tensor:
    top2 = logits.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).min()


@pytest.mark.parametrize("model", list(MODELS))
def test_logits_match_transformers_bf16(tiny_model_factory, model):
    """The engine's bf16 model against transformers' own bf16 forward of the same
    checkpoint: a 40-token prompt in one packed prefill, every position's logits."""
    from transformers import AutoModelForCausalLM

    from engine.loader import load_model
    from tests.engine.simple_runner import SimplePagedRunner

    arch, overrides = MODELS[model]
    model_dir = tiny_model_factory(arch=arch, **overrides)
    ids = prompts_of_lengths([40], seed=5)[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    runner = SimplePagedRunner(load_model(model_dir, dtype="bfloat16").model, num_blocks=8)
    runner.add_sequence(0)
    ours = runner.step([(0, ids)], all_logits=True)
    err = (ours - ref).abs().max().item()
    assert err <= LOGIT_TOL * ref.abs().max().item(), f"max |diff| {err:.4f}"
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9  # near-ties may flip
