"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
import sys

from engine.config import EngineConfig
from engine.io.outputs import RequestOutput
from engine.io.sampling_params import SamplingParams


class LLM:
    """Generate for a list of prompts with continuous batching.

    A prompt is a string or a list of token ids. Keyword arguments beyond the named ones
    are EngineConfig fields (``max_num_batched_tokens``, ``kv_cache_memory_gib`` ...).
    """

    def __init__(
        self,
        model: str | None = None,
        draft_model: str | None = None,
        speculative_method: str | None = None,
        num_speculative_tokens: int = 4,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 256,
        device: str = "auto",
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        seed: int = 0,
        **engine_kwargs,
    ) -> None:
        from engine.core.llm_engine import LLMEngine

        self.config = EngineConfig(
            model=model,
            draft_model=draft_model,
            speculative_method=speculative_method,
            num_speculative_tokens=num_speculative_tokens,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs,
            device=device,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            seed=seed,
            **engine_kwargs,
        )
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        priorities: list[int] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        prompts = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(
                f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts"
            )
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        for i, (request_id, prompt, p) in enumerate(zip(ids, prompts, params_list)):
            priority = priorities[i] if priorities else 0
            self.engine.add_request(request_id, prompt, p, priority=priority)
        return self._run(ids, use_tqdm)

    def chat(
        self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None
    ) -> RequestOutput:
        request_id = f"llm-{next(self._ids)}"
        self.engine.add_request(request_id, None, sampling_params, messages=messages)
        return self._run([request_id], False)[0]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        progress = _Progress(len(ids)) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                _accumulate(results, delta)
                if delta.finished and progress is not None:
                    progress.update()
        if progress is not None:
            progress.close()
        return [results[i] for i in ids]


def _accumulate(results: dict[str, RequestOutput], delta: RequestOutput) -> None:
    acc = results.get(delta.request_id)
    if acc is None:
        results[delta.request_id] = RequestOutput(
            request_id=delta.request_id,
            prompt_token_ids=delta.prompt_token_ids,
            token_ids=list(delta.token_ids),
            text=delta.text,
            finished=delta.finished,
            finish_reason=delta.finish_reason,
            metrics=delta.metrics,
            stop_reason=delta.stop_reason,
            logprobs=list(delta.logprobs) if delta.logprobs is not None else None,
        )
        return
    acc.token_ids.extend(delta.token_ids)
    acc.text += delta.text
    acc.finished = delta.finished
    acc.finish_reason = delta.finish_reason
    acc.stop_reason = delta.stop_reason
    acc.metrics = delta.metrics
    if delta.logprobs is not None:
        acc.logprobs = (acc.logprobs or []) + list(delta.logprobs)


def _as_prompt_list(prompts) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("prompts must be a non-empty string, token id list, or list of them")
    return prompts


class _Progress:
    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc="generating", unit="req", file=sys.stderr)

    def update(self) -> None:
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
