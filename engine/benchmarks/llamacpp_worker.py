"""llama.cpp as a `bench offline` baseline, run in its own virtualenv.

    <llamacpp venv>/bin/python llamacpp_worker.py < request.json

Standalone: imports llama_cpp and the protocol file beside it, never specserve. It drives
llama.cpp's C API the way llama.cpp's own `simple` example does (llama_decode, then
llama_sampler_sample with a greedy sampler, both in C), not the Python `Llama` class,
whose per-token Python sampling costs llama.cpp 10-15% at batch 1: llama.cpp is timed
at its engine. One request at a time, greedy, EOS ignored: exactly output_len tokens.
The KV cache of the longest prefix shared with the previous prompt is kept, as
llama.cpp's server does for its users.
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


class _Engine:
    """A model, a context and a greedy sampler, through the C API."""

    def __init__(self, lib, path: str, n_ctx: int, threads: int) -> None:
        self.lib = lib
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        self.model = lib.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise WorkerError("failed", f"llama.cpp cannot load {path}")
        cparams = lib.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = n_ctx, n_ctx, n_ctx
        cparams.n_threads, cparams.n_threads_batch = threads, threads
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
        self.sampler = chain
        self.cached: list[int] = []  # the tokens whose KV the context holds

    def decode(self, tokens: list[int]) -> None:
        array = (self.lib.llama_token * len(tokens))(*tokens)
        status = self.lib.llama_decode(self.ctx, self.lib.llama_batch_get_one(array, len(tokens)))
        if status != 0:
            raise WorkerError("failed", f"llama_decode returned {status}")
        self.cached += tokens

    def generate(self, ids: list[int], output_len: int) -> dict:
        start = time.perf_counter()
        keep = _common_prefix(self.cached, ids[:-1])  # at least the last token is decoded
        self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(self.ctx), 0, keep, -1)
        self.cached = self.cached[:keep]
        self.decode(ids[keep:])
        first, count = None, 0
        while True:
            token = self.lib.llama_sampler_sample(self.sampler, self.ctx, -1)
            count += 1
            if first is None:
                first = time.perf_counter()
            if count == output_len:
                break
            self.decode([token])
        end = time.perf_counter()
        return {"ttft_s": first - start, "latency_s": end - start, "num_tokens": count}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _run(llama_cpp, request: dict) -> int:
    prompts, output_len = request["prompts"], request["output_len"]
    n_ctx = max(len(p) for p in prompts) + output_len + 16
    engine = _Engine(llama_cpp, request["model"], n_ctx, request["num_threads"])
    engine.generate(prompts[0], min(output_len, 8))  # warm-up
    engine.cached = []
    engine.lib.llama_memory_clear(engine.lib.llama_get_memory(engine.ctx), True)
    requests = []
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        requests.append(engine.generate(ids, output_len))
        print(f"llama.cpp: request {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    duration = time.perf_counter() - start
    check_counts(requests, output_len, "llama.cpp")
    emit_result("llama.cpp", llama_cpp.__version__, False, duration, requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
