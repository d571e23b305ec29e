"""A plain, one-sequence reference for penalties, logit bias and min_tokens (the
semantics of OpenAI and vLLM, written from their documentation), applied to
transformers' logits step by step. The engine's batched version must agree with it."""

from __future__ import annotations

import torch

from engine.io.sampling_params import SamplingParams
from tests.engine.engine_helpers import _hf_model


def adjust(
    logits: torch.Tensor,  # [vocab_size], raw
    prompt: list[int],
    output: list[int],
    params: SamplingParams,
    stop_ids: set[int],
) -> torch.Tensor:
    logits = logits.clone()
    f32 = lambda value: torch.tensor(value, dtype=torch.float32)  # noqa: E731
    for token_id, value in params.logit_bias.items():
        logits[token_id] += f32(value)
    if len(output) < params.min_tokens:
        for token_id in stop_ids:
            logits[token_id] = float("-inf")
    r = f32(params.repetition_penalty)
    for token_id in set(prompt) | set(output):
        x = logits[token_id]
        logits[token_id] = x / r if x > 0 else x * r
    for token_id in set(output):
        logits[token_id] -= f32(params.frequency_penalty) * output.count(token_id)
        logits[token_id] -= f32(params.presence_penalty)
    return logits


def stop_ids_of(params: SamplingParams, eos_ids: set[int]) -> set[int]:
    return set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)


def reference_greedy(
    model_dir: str, prompt: list[int], params: SamplingParams, eos_ids: set[int]
) -> list[int]:
    """Greedy decoding of transformers' model with ``adjust`` before each argmax; stops
    at a stop token (kept) or max_tokens."""
    model = _hf_model(model_dir)
    stop_ids = stop_ids_of(params, eos_ids)
    output: list[int] = []
    with torch.no_grad():
        while len(output) < params.max_tokens:
            logits = model(torch.tensor([prompt + output])).logits[0, -1]
            token = int(adjust(logits, prompt, output, params, stop_ids).argmax())
            output.append(token)
            if token in stop_ids:
                break
    return output
