"""Helpers for engine tests: build engines on tiny models, run them step by step with
invariant checks, and compute transformers' greedy reference."""

from __future__ import annotations

import functools

import pytest
import torch

from engine.attention import xformers_problem
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.io.sampling_params import SamplingParams

# Marks for test rows that need a GPU: skipped on CPU-only machines (CI), run by
# `bash scripts/gpu_check.sh` (marker `gpu`) where torch sees one.
GPU_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine"),
]
XFORMERS_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        xformers_problem("cuda") is not None,
        reason="needs CUDA and an xformers build that runs here",
    ),
]


# (speculative_method, engine overrides) that the greedy losslessness tests run: plain,
# chunked prefill, preemption, for n-gram and draft-model speculation.
SPEC_CONFIGS = [
    ("ngram", {}),
    ("ngram", {"max_num_batched_tokens": 24}),  # chunked prefill
    ("ngram", {"num_kv_blocks": 10}),  # preemption
    ("draft", {}),
    ("draft", {"max_num_batched_tokens": 24, "num_kv_blocks": 12}),
    ("hybrid", {}),  # n-gram where the context repeats, the trained draft elsewhere
    ("hybrid", {"max_num_batched_tokens": 24, "num_kv_blocks": 12}),
    ("eagle", {}),  # the target's own hidden states drive a one-layer draft
    ("eagle", {"max_num_batched_tokens": 24, "num_kv_blocks": 12}),
    ("hybrid", {"draft": "eagle"}),  # n-gram and EAGLE rows in one verification
]


def spec_kwargs(method: str, engine_kwargs: dict, draft_dirs: dict[str, str]) -> dict:
    """Engine overrides for a SPEC_CONFIGS row: the method, its draft (``draft`` names
    which of ``draft_dirs``; default: the method's own) and the row's settings."""
    kwargs = dict(engine_kwargs)
    draft = kwargs.pop("draft", method)
    if draft in draft_dirs:
        kwargs["draft_model"] = draft_dirs[draft]
    return dict(speculative_method=method, **kwargs)


def draft_proposer(engine: LLMEngine):
    """The draft-model proposer, inside a hybrid one or not (None without one)."""
    return getattr(engine.proposer, "_draft", engine.proposer)


def make_engine(model_dir: str, **overrides) -> LLMEngine:
    # The speculation gate off: tests that count drafts need them whatever a tiny model's
    # step times say (tests/scheduler/test_spec_gate.py runs it on)
    config = dict(
        model=model_dir,
        speculative_method="none",
        num_kv_blocks=128,
        device="cpu",
        dtype="float32",
        speculation_gate=False,
    )
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def check_pools(engine: LLMEngine) -> None:
    """Every pool is consistent, and no request holds a block beyond its KV length
    (lookahead slots of rejected drafts are gone after each step)."""
    engine.kv_manager.check_integrity()
    pools = [engine.kv_manager]
    proposer_kv = getattr(draft_proposer(engine), "kv", None)
    if proposer_kv is not None:
        proposer_kv.check_integrity()
        pools.append(proposer_kv)
    bs = engine.config.block_size
    for request in engine.scheduler.running:
        held = len(engine.kv_manager.get_block_ids(request.request_id))
        assert held == -(-request.num_computed_tokens // bs), request.request_id


def run_to_completion(
    engine: LLMEngine, arrivals: dict[int, list] | None = None, max_steps: int = 10_000
) -> dict[str, dict]:
    """Step until idle; `arrivals` maps step index -> [(request_id, prompt, params)].
    Returns request_id -> {"token_ids", "text", "logprobs", "finish_reason", "metrics",
    "detail"}."""
    arrivals = dict(arrivals or {})
    results: dict[str, dict] = {}
    for step in range(max_steps):
        for request_id, prompt, params in arrivals.pop(step, []):
            engine.add_request(request_id, prompt, params)
        if not engine.has_unfinished_requests() and not arrivals:
            break
        for out in engine.step():
            r = results.setdefault(out.request_id, {"token_ids": [], "text": "", "logprobs": []})
            r["token_ids"] += out.token_ids
            r["text"] += out.text
            r["logprobs"] += out.logprobs or []
            if out.finished:
                r["finish_reason"] = out.finish_reason
                r["metrics"] = out.metrics
                r["detail"] = out.finish_detail
        check_pools(engine)
    return results


def assert_all_blocks_released(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    for kv in (engine.kv_manager, getattr(draft_proposer(engine), "kv", None)):
        if kv is not None:
            kv.check_integrity()
            assert kv.usage == 0.0
            assert kv.num_free_blocks == kv.num_blocks


@functools.lru_cache(maxsize=8)
def _hf_model(model_dir: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def hf_greedy(model_dir: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    model = _hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def prompts_of_lengths(lengths: list[int], vocab: int = 200, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


class LogitPoison:
    """Writes ``value`` into the logits rows ``rows(request, drafts)`` names (0 = the
    request's first verified row, j = the row after its draft j - 1; all columns, or
    ``column``) every step, before verification sees them: a model that produces NaN
    or Inf for chosen requests at chosen steps."""

    def __init__(self, engine: LLMEngine, rows, value: float = float("nan"), column=None):
        self.rows, self.value = rows, value
        self.columns = slice(None) if column is None else column
        self.num_poisoned = 0
        self._layout: tuple[list, list] = ([], [])
        build, execute = engine._build_inputs, engine.runner.execute

        def build_inputs(sched):
            seqs, states, drafts, trees = build(sched)
            self._layout = (states, drafts)
            return seqs, states, drafts, trees

        def run(prepared):
            logits = execute(prepared)
            row = 0
            for state, request_drafts in zip(*self._layout, strict=True):
                for j in self.rows(state.request, request_drafts):
                    with torch.inference_mode():  # the logits are inference tensors
                        logits[row + j, self.columns] = self.value
                    self.num_poisoned += 1
                row += 1 + len(request_drafts)
            return logits

        engine._build_inputs, engine.runner.execute = build_inputs, run
