"""Huge prompts against a running server: does another stream stall, does health lag?

    .venv/bin/specserve serve --port 50099 &
    .venv/bin/python scripts/prompt_flood.py localhost:50099 text   # or: chat, ids, vllm-ids

One greedy stream runs; after 20 s of baseline, 20 requests with a 522k-character
prompt arrive at once (text, or one chat message), or 6 requests of 15M token ids with
truncate_prompt_tokens 16 (ids: specserve.v1, vllm-ids: VllmEngine). Prints the
stream's longest and 99th-percentile wait between deltas before and during the flood (a
longer window sees a larger maximum by chance alone, hence the percentile), how long the
flood took, and the slowest health answer (polled every 20 ms) during it.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from smg_grpc_proto.generated import vllm_engine_pb2 as vpb  # noqa: E402

from engine.client import SpecserveClient  # noqa: E402
from engine.rpc import generation_pb2 as pb  # noqa: E402

NUM_PROMPTS = 20
PROMPT_CHARS = 522_000
NUM_ID_PROMPTS = 6
PROMPT_IDS = 15_000_000  # about 14 MiB on the wire, under the default 16 MiB cap
BASELINE_S = 20.0
KINDS = ("text", "chat", "ids", "vllm-ids")


def main(target: str, kind: str) -> None:
    client = SpecserveClient(target)
    client.wait_serving(300)
    send, num_prompts = _sender(client, target, kind)  # before anything is measured
    times: list[float] = []
    threading.Thread(target=_stream, args=(client, times), daemon=True).start()
    time.sleep(BASELINE_S)
    baseline_end = time.monotonic()
    latencies: list[float] = []
    done = threading.Event()
    threading.Thread(target=_poll_health, args=(client, latencies, done), daemon=True).start()
    flood = [threading.Thread(target=send) for _ in range(num_prompts)]
    start = time.monotonic()
    for t in flood:
        t.start()
    for t in flood:
        t.join()
    end = time.monotonic()
    time.sleep(1.5)  # the stream's first delta after the flood closes the last gap
    done.set()
    before = _gaps(times, times[0] + 1, baseline_end)
    during = _gaps(times, start, end)
    print(
        f"{kind}: stream's gaps max/p99 {max(before):.3f}/{_p99(before):.3f} s before, "
        f"{max(during):.3f}/{_p99(during):.3f} s during the flood; flood {end - start:.1f} s; "
        f"slowest health answer {max(latencies) * 1000:.0f} ms"
    )


def _stream(client: SpecserveClient, times: list[float]) -> None:
    prompt = "Tell me a long story about the sea."
    try:
        for _ in client.generate(prompt, max_tokens=3000, ignore_eos=True, temperature=0.0):
            times.append(time.monotonic())
    except grpc.RpcError as exc:
        print(f"stream failed: {exc.code().name}", file=sys.stderr)


def _poll_health(client: SpecserveClient, latencies: list[float], done: threading.Event) -> None:
    while not done.is_set():
        t0 = time.monotonic()
        client.health()
        latencies.append(time.monotonic() - t0)
        time.sleep(0.02)


def _sender(client: SpecserveClient, target: str, kind: str) -> tuple:
    """(what one flood thread runs, how many threads)."""
    if kind in ("text", "chat"):
        text = ("The quick brown fox jumps over the lazy dog. " * 12000)[:PROMPT_CHARS]
        prompt = {"messages": [{"role": "user", "content": text}]} if kind == "chat" else {}

        def send() -> None:
            with contextlib.suppress(grpc.RpcError):  # refused as too long for the context
                client.generate_complete(None if prompt else text, max_tokens=1, **prompt)

        return send, NUM_PROMPTS
    method, data = _id_request(kind)
    channel = grpc.insecure_channel(target)

    def send_ids() -> None:  # answered as the last 16 ids alone
        call = channel.unary_stream(method) if kind == "vllm-ids" else channel.unary_unary(method)
        result = call(data, timeout=120)
        if kind == "vllm-ids":
            list(result)

    return send_ids, NUM_ID_PROMPTS


def _id_request(kind: str) -> tuple[str, bytes]:
    """The method and the request, serialized once (15M ids take a second to build)."""
    ids = itertools.repeat(5, PROMPT_IDS)
    if kind == "ids":
        sampling = pb.SamplingOptions(max_tokens=1, truncate_prompt_tokens=16)
        request = pb.GenerateRequest(sampling=sampling)
        request.token_ids.ids.extend(ids)
        return "/specserve.v1.Generation/GenerateComplete", request.SerializeToString()
    vllm_sampling = vpb.SamplingParams(max_tokens=1, truncate_prompt_tokens=16)
    vllm_request = vpb.GenerateRequest(request_id="flood", sampling_params=vllm_sampling)
    vllm_request.tokenized.input_ids.extend(ids)
    return "/vllm.grpc.engine.VllmEngine/Generate", vllm_request.SerializeToString()


def _gaps(times: list[float], start: float, end: float) -> list[float]:
    """The waits between two deltas that overlap [start, end]."""
    return [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]


def _p99(gaps: list[float]) -> float:
    return sorted(gaps)[int(0.99 * (len(gaps) - 1))]


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in KINDS:
        sys.exit(f"usage: prompt_flood.py HOST:PORT {'|'.join(KINDS)}")
    main(sys.argv[1], sys.argv[2])
