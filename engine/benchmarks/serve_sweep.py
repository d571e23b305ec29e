"""Runs of `specserve bench serve`: one load shape, or a sweep over concurrency levels
followed by a search for the highest request rate that still meets the SLO."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Protocol

from engine.benchmarks import serve_workload as wl
from engine.benchmarks.serve_runner import LoadGenerator, LoadShape, Transport
from engine.benchmarks.serve_stats import (
    RequestRecord,
    knee_index,
    summarize,
    throughput_timeline,
)

# seed -> an endless request stream. Each run starts a fresh stream from the same seed,
# so every level of a sweep sees the same prompts in the same order.
Workload = Callable[[int], Iterator[wl.BenchRequest]]


class Tokenizer(Protocol):
    """The server's Tokenize RPC (gRPC) or a local tokenizer (OpenAI HTTP)."""

    async def tokenize(
        self, text: str | None = None, *, messages=None, timeout: float | None = None
    ) -> list[int]: ...


async def build_workload(
    args: argparse.Namespace, client: Tokenizer, max_model_len: int
) -> Workload:
    """Reads and tokenizes what the dataset needs once (synthetic and ShareGPT only)."""
    output_len = wl.LengthDist(args.output_len, args.range_ratio)
    if args.dataset == "synthetic":
        input_len = wl.LengthDist(args.input_len, args.range_ratio)
        corpus = await client.tokenize(wl.corpus_text(), timeout=60)
        return lambda seed: wl.synthetic_requests(corpus, input_len, output_len, seed)
    if args.dataset == "shared-prefix":
        num, chars = args.num_prefixes, args.prefix_chars
        return lambda seed: wl.shared_prefix_requests(num, chars, output_len, seed)
    if args.dataset in ("chat", "grounded", "json", "repeated"):
        items = wl.builtin_items(args.dataset)
    elif not args.dataset_path:
        raise ValueError(f"--dataset {args.dataset} needs --dataset-path")
    elif args.dataset == "jsonl":
        items = wl.load_jsonl(args.dataset_path)
    else:
        items = await _sharegpt_items(args, client, max_model_len)
    return lambda seed: wl.text_requests(items, output_len, seed)


async def _sharegpt_items(args, client: Tokenizer, max_model_len: int):
    pairs = wl.load_sharegpt(args.dataset_path)
    # Only as many conversations as the run can use need tokenizing.
    limit = max(args.num_requests or 0, 1000)
    pairs = pairs[:limit]
    gate = asyncio.Semaphore(16)

    async def count(text: str, chat: bool) -> int:
        async with gate:
            messages = [{"role": "user", "content": text}] if chat else None
            return len(await client.tokenize(None if chat else text, messages=messages))

    chat = not args.no_chat_template
    prompt_lens = await asyncio.gather(*(count(p, chat) for p, _ in pairs))
    reply_lens = await asyncio.gather(*(count(r, False) for _, r in pairs))
    items = wl.sharegpt_items(pairs, list(reply_lens), list(prompt_lens), max_model_len)
    if not items:
        raise ValueError(f"{args.dataset_path}: no conversation fits max_model_len")
    return items


class Bench:
    def __init__(
        self,
        transport: Transport,
        workload: Workload,
        slo: dict[str, float],
        slo_attainment: float,
        progress: bool = True,
    ) -> None:
        self._transport = transport
        self._workload = workload
        self._slo = slo
        self._slo_attainment = slo_attainment
        self._progress = progress

    async def warmup(self, num_requests: int, concurrency: int) -> None:
        """Unmeasured requests from a different seed (the measured stream is unchanged)."""
        if num_requests > 0:
            shape = LoadShape(concurrency=min(concurrency, num_requests), num_requests=num_requests)
            await self._measure(shape, "warm-up", seed_offset=1)

    async def single(self, shape: LoadShape) -> dict:
        return {"kind": "run", **await self._measure(shape, _describe(shape))}

    async def sweep(self, levels: list[int], base: LoadShape, rate_steps: int) -> dict:
        runs = []
        for c in levels:
            runs.append(
                {
                    "concurrency": c,
                    **await self._measure(
                        replace(base, concurrency=c, max_concurrency=None), f"concurrency {c}"
                    ),
                }
            )
        summaries = [r["summary"] for r in runs]
        knee = knee_index([s["output_throughput"] for s in summaries])
        result = {"kind": "sweep", "levels": runs, "knee_concurrency": levels[knee]}
        if self._slo:
            result["rate_search"] = await self._rate_search(summaries, base, rate_steps)
        return result

    async def _rate_search(self, summaries: list[dict], base: LoadShape, steps: int) -> dict:
        """Bisect open-loop (Poisson) request rates. The bracket comes from the closed-loop
        levels: by Little's law a level that met the SLO at throughput X sustains about X
        requests/s; the first level past it that failed bounds the search from above."""
        lo, hi = 0.0, 0.0
        for s in summaries:
            if self._meets(s):
                lo = max(lo, s["request_throughput"])
            elif s["request_throughput"] > lo:
                hi = hi or s["request_throughput"]
        if not hi:  # every level met the SLO (or none did): open the bracket upwards
            hi = lo * 1.5 or summaries[0]["request_throughput"]
        runs, best = [], None
        rate = lo or hi / 2
        for _ in range(steps):
            shape = replace(base, concurrency=None, request_rate=rate, max_concurrency=None)
            measured = await self._measure(shape, f"rate {rate:.2f}/s")
            ok = self._meets(measured["summary"])
            runs.append({"request_rate": rate, "meets_slo": ok, **measured})
            best = max(best or 0.0, rate) if ok else best
            lo, hi = (rate, hi) if ok else (lo, rate)
            rate = (lo + hi) / 2
        return {"max_request_rate": best, "bracket": [lo, hi], "runs": runs}

    def _meets(self, summary: dict) -> bool:
        return summary["num_errors"] == 0 and summary["slo_attainment"] >= self._slo_attainment

    async def _measure(self, shape: LoadShape, what: str, seed_offset: int = 0) -> dict:
        bar = _progress_bar(shape, what, self._progress)

        def done(record: RequestRecord) -> None:
            bar.update(1)
            if record.error:
                bar.set_postfix_str(f"errors: {record.error}", refresh=False)

        generator = LoadGenerator(self._transport, on_done=done)
        try:
            records, duration = await generator.run(self._workload(shape.seed + seed_offset), shape)
        finally:
            bar.close()
        return {
            "summary": summarize(records, duration, self._slo),
            "throughput_timeline_tok_s": throughput_timeline(records),
            "requests": [_record_json(r) for r in records],
        }


def _describe(shape: LoadShape) -> str:
    if shape.concurrency is not None:
        return f"concurrency {shape.concurrency}"
    return f"rate {shape.request_rate:g}/s"


def _progress_bar(shape: LoadShape, what: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=shape.num_requests,
        desc=what,
        unit="req",
        file=sys.stderr,
        disable=not enabled,
        dynamic_ncols=True,
        leave=False,
    )


def _record_json(r: RequestRecord) -> dict:
    def ms(v: float | None) -> float | None:
        return None if v is None or math.isnan(v) else round(v * 1e3, 3)

    return {
        "index": r.index, "start_s": round(r.start, 4), "ttft_ms": ms(r.ttft),
        "tpot_ms": ms(r.tpot), "e2e_ms": ms(r.e2e), "itl_ms": [ms(x) for x in r.itls],
        "prompt_tokens": r.num_prompt_tokens, "output_tokens": r.num_output_tokens,
        "draft_tokens": r.num_draft_tokens, "accepted_tokens": r.num_accepted_tokens,
        "finish_reason": r.finish_reason, "error": r.error,
    }  # fmt: skip
