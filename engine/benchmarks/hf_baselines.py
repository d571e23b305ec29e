"""The baselines users would otherwise pick, run on the same weights and prompts:
transformers generate() (static padded batches), generate_batch() (transformers'
continuous batching) and assisted generation with prompt lookup (batch 1 only)."""

from __future__ import annotations

import time

import torch

from engine.benchmarks.report import RequestTiming, RunResult, summarize


class _Clock:
    """A logits processor that timestamps every decoding step (first call = TTFT)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def load_hf_model(model_dir, device: str, dtype: torch.dtype = torch.float32):
    """The same weights in transformers, in the dtype specserve serves them in."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return model.to(device).eval()


@torch.inference_mode()
def run_generate(
    model,
    prompts: list[list[int]],
    output_len: int,
    batch_size: int,
    pad_id: int,
    progress=None,
    assistant_lookup: int | None = None,
) -> RunResult:
    from transformers import LogitsProcessorList

    timings: list[RequestTiming] = []
    start_all = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        batch = prompts[b : b + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        clock = _Clock()
        start = time.perf_counter()
        extra = {}
        if assistant_lookup:
            extra["prompt_lookup_num_tokens"] = assistant_lookup
        out = model.generate(
            ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=pad_id,
            logits_processor=LogitsProcessorList([clock]),
            **extra,
        )
        end = time.perf_counter()
        num_new = out.shape[1] - width
        for _ in batch:
            timings.append(
                RequestTiming(start, clock.times[0] if clock.times else end, end, num_new)
            )
        if progress is not None:
            progress.update(len(batch))
    name = "hf assisted (prompt lookup)" if assistant_lookup else "hf generate()"
    return summarize(name, time.perf_counter() - start_all, timings)


# no_grad, not inference_mode: generate_batch builds its static tensors here and updates
# them in place from its own thread, which inference tensors forbid (seen on CUDA with
# transformers 5.17: every request failed).
@torch.no_grad()
def run_generate_batch(
    model, prompts: list[list[int]], output_len: int, progress=None
) -> RunResult:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    start = time.perf_counter()
    outputs = model.generate_batch(
        inputs=prompts,
        generation_config=config,
        record_timestamps=True,
        progress_bar=progress is not None,
    )
    duration = time.perf_counter() - start
    failed = len(prompts) - sum(1 for out in outputs.values() if len(out.generated_tokens))
    if failed:
        raise RuntimeError(
            f"hf generate_batch() returned no tokens for {failed} of {len(prompts)} requests "
            "(transformers' log above says why)"
        )
    timings = []
    for out in outputs.values():
        stamps = list(getattr(out, "timestamps", None) or [])
        n = len(out.generated_tokens)
        first = stamps[0] if stamps else None
        last = stamps[-1] if stamps else None
        timings.append(RequestTiming(start, _to_perf(first, start), _to_perf(last, start), n))
    return summarize("hf generate_batch()", duration, timings)


def _to_perf(stamp, start: float) -> float | None:
    """generate_batch timestamps are perf_counter seconds in recent transformers."""
    if stamp is None:
        return None
    return float(stamp) if float(stamp) >= start - 1.0 else None
