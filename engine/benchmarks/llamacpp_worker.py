"""llama.cpp (llama-cpp-python) as a `bench offline` baseline, run in its own virtualenv.

    <llamacpp venv>/bin/python llamacpp_worker.py < request.json

Standalone: imports llama_cpp and the protocol file beside it, never specserve. One
request at a time (the high-level API has no batching), greedy, EOS ignored: the token
stream is cut after exactly output_len tokens. llama.cpp keeps the KV cache of the longest
prefix shared with the previous prompt, as it does for its users.
"""

from __future__ import annotations

import sys
import time

from external_protocol import (
    WorkerError,
    check_counts,
    emit_result,
    serve,
)


def main() -> int:
    return serve("llama_cpp", _run, check=_one_at_a_time)


def _one_at_a_time(request: dict) -> None:
    if request["concurrency"] != 1:
        raise WorkerError("bad_request", "llama.cpp runs one request at a time")


def _run(llama_cpp, request: dict) -> int:
    prompts, output_len = request["prompts"], request["output_len"]
    threads = request["num_threads"]
    llm = llama_cpp.Llama(
        model_path=request["model"],
        n_ctx=max(len(p) for p in prompts) + output_len + 16,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        seed=0,
        verbose=False,
    )
    _generate(llm, prompts[0], min(output_len, 8))  # warm-up
    llm.reset()
    requests = []
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        requests.append(_generate(llm, ids, output_len))
        print(f"llama.cpp: request {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    duration = time.perf_counter() - start
    check_counts(requests, output_len, "llama.cpp")
    emit_result("llama.cpp", llama_cpp.__version__, False, duration, requests)
    return 0


def _generate(llm, ids: list[int], output_len: int) -> dict:
    start = time.perf_counter()
    first = None
    count = 0
    # generate() samples forever, EOS included; stopping at output_len ignores EOS.
    stream = llm.generate(
        ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True
    )
    for _token in stream:
        count += 1
        if first is None:
            first = time.perf_counter()
        if count == output_len:
            break
    stream.close()
    end = time.perf_counter()
    return {
        "ttft_s": None if first is None else first - start,
        "latency_s": end - start,
        "num_tokens": count,
    }


if __name__ == "__main__":
    sys.exit(main())
