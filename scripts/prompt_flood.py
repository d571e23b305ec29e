"""Huge prompts and hostile bodies against a running server: does another stream stall,
does health lag?

    .venv/bin/specserve serve --port 50099 &
    .venv/bin/python scripts/prompt_flood.py localhost:50099 text   # or another kind
    .venv/bin/python scripts/prompt_flood.py localhost:50099 embed 5   # five floods

One greedy stream runs; after 20 s of baseline, a flood arrives at once:
  text, chat     20 requests with a 522k-character prompt (text, or one chat message)
  ids, vllm-ids  6 requests of 15M token ids with truncate_prompt_tokens 16
                 (ids: specserve.v1, vllm-ids: VllmEngine)
  text-ids, vllm-text-ids
                 the same with a text field before the ids (the later ids win)
  embed          6 VllmEngine Embed bodies of 15M ids (answered UNIMPLEMENTED)
  stop           6 specserve.v1 bodies of 4.9M stop strings (refused)
  abort          6 VllmEngine Abort bodies of 0.8M request ids (refused by size)
The bodies are about 14 MiB each, under the default 16 MiB cap, sent from a process of
their own (as clients' are: sender threads here would compete with the health calls
being timed for this process's GIL). Prints, per flood, the stream's longest and
99th-percentile wait between deltas during it (a longer window sees a larger maximum by
chance alone, hence the percentile), how long it took, and the slowest health answer
(polled every 20 ms) during it; with a count, that many floods 3 s apart and the median
(range) of each number.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import statistics
import sys
import threading
import time
from collections.abc import Callable
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
PAUSE_S = 3.0
BODY_KINDS = ("ids", "vllm-ids", "text-ids", "vllm-text-ids", "embed", "stop", "abort")
KINDS = ("text", "chat", *BODY_KINDS)
STREAMING = ("/specserve.v1.Generation/Generate", "/vllm.grpc.engine.VllmEngine/Generate")


def main(target: str, kind: str, num_floods: int) -> None:
    client = SpecserveClient(target)
    client.wait_serving(300)
    flood = _flooder(client, target, kind)  # before anything is measured
    times: list[float] = []
    threading.Thread(target=_stream, args=(client, times), daemon=True).start()
    time.sleep(BASELINE_S)
    before = _gaps(times, times[0] + 1, time.monotonic())
    print(f"{kind}: stream's gaps max/p99 {max(before):.3f}/{_p99(before):.3f} s before")
    results = [_flood(client, times, flood) for _ in range(num_floods)]
    for result in results:
        print(f"{kind}: " + _row(result))
    if num_floods > 1:
        summary = [(statistics.median(v), min(v), max(v)) for v in zip(*results)]
        print(f"{kind}, median (range) of {num_floods}: " + _row(summary))


def _flood(client: SpecserveClient, times: list[float], flood: Callable[[], None]) -> tuple:
    """(longest gap, p99 gap, flood s, slowest health ms) of one flood."""
    latencies: list[float] = []
    done = threading.Event()
    threading.Thread(target=_poll_health, args=(client, latencies, done), daemon=True).start()
    time.sleep(0.5)
    num_before = len(latencies)
    start = time.monotonic()
    flood()
    end = time.monotonic()
    num_during = len(latencies)
    time.sleep(PAUSE_S)  # the stream's first delta after the flood closes the last gap
    done.set()
    during = _gaps(times, start, end)
    # A call still waiting when the flood ended is counted: it was slowed by it.
    health = latencies[num_before : num_during + 1]
    return max(during), _p99(during), end - start, max(health) * 1000


def _row(values) -> str:
    def show(value, fmt: str) -> str:
        if isinstance(value, tuple):
            return f"{value[0]:{fmt}} ({value[1]:{fmt}}-{value[2]:{fmt}})"
        return f"{value:{fmt}}"

    gap, p99, flood_s, health_ms = values
    return (
        f"gaps max/p99 {show(gap, '.3f')}/{show(p99, '.3f')} s during the flood; "
        f"flood {show(flood_s, '.2f')} s; slowest health answer {show(health_ms, '.0f')} ms"
    )


def _stream(client: SpecserveClient, times: list[float]) -> None:
    """One greedy stream after another, for the whole run (speculation makes a
    3000-token stream last ~10 s on the default model)."""
    prompt = "Tell me a long story about the sea."
    while True:
        try:
            for _ in client.generate(prompt, max_tokens=3000, ignore_eos=True, temperature=0.0):
                times.append(time.monotonic())
        except grpc.RpcError as exc:
            print(f"stream failed: {exc.code().name}", file=sys.stderr)
            return


def _poll_health(client: SpecserveClient, latencies: list[float], done: threading.Event) -> None:
    while not done.is_set():
        t0 = time.monotonic()
        client.health()
        latencies.append(time.monotonic() - t0)
        time.sleep(0.02)


def _flooder(client: SpecserveClient, target: str, kind: str) -> Callable[[], None]:
    """What sends one flood and returns when every request of it has been answered."""
    if kind in ("text", "chat"):
        text = ("The quick brown fox jumps over the lazy dog. " * 12000)[:PROMPT_CHARS]
        prompt = {"messages": [{"role": "user", "content": text}]} if kind == "chat" else {}

        def send() -> None:
            with contextlib.suppress(grpc.RpcError):  # refused as too long for the context
                client.generate_complete(None if prompt else text, max_tokens=1, **prompt)

        def flood() -> None:
            threads = [threading.Thread(target=send) for _ in range(NUM_PROMPTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        return flood
    # Bodies go from a process of their own, as clients' do: sender threads here would
    # compete for this process's GIL with the health calls being timed.
    context = multiprocessing.get_context("spawn")
    ready, go, done = context.Event(), context.Event(), context.Event()
    sender = context.Process(target=_send_bodies, args=(target, kind, ready, go, done),
                             daemon=True)  # fmt: skip
    sender.start()
    ready.wait()

    def flood_bodies() -> None:
        done.clear()
        go.set()
        done.wait()

    return flood_bodies


def _send_bodies(target: str, kind: str, ready, go, done) -> None:
    """In the sender process: NUM_ID_PROMPTS bodies at once each time ``go`` is set."""
    method, data = _body(kind)
    channel = grpc.insecure_channel(target)
    grpc.channel_ready_future(channel).result(timeout=60)

    def send() -> None:
        try:
            if method in STREAMING:
                list(channel.unary_stream(method)(data, timeout=300))
            else:
                channel.unary_unary(method)(data, timeout=300)
        except grpc.RpcError as exc:  # embed, stop and abort are refused
            if kind in ("ids", "vllm-ids", "text-ids", "vllm-text-ids"):
                print(f"{kind} refused: {exc.code().name}: {exc.details()}", file=sys.stderr)

    ready.set()
    while True:
        go.wait()
        go.clear()
        threads = [threading.Thread(target=send) for _ in range(NUM_ID_PROMPTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done.set()


def _body(kind: str) -> tuple[str, bytes]:
    """The method and the request, serialized once (15M ids take a second to build).
    Serialized messages concatenate as a merge: a text field before the ids is replaced
    by them (the later member of the prompt's oneof wins)."""
    ids = itertools.repeat(5, PROMPT_IDS)
    if kind in ("ids", "text-ids"):
        sampling = pb.SamplingOptions(max_tokens=1, truncate_prompt_tokens=16)
        request = pb.GenerateRequest(sampling=sampling)
        request.token_ids.ids.extend(ids)
        text = pb.GenerateRequest(text="x").SerializeToString() if kind == "text-ids" else b""
        method = "Complete" if kind == "ids" else ""
        return f"/specserve.v1.Generation/Generate{method}", text + request.SerializeToString()
    if kind in ("vllm-ids", "vllm-text-ids"):
        vllm_sampling = vpb.SamplingParams(max_tokens=1, truncate_prompt_tokens=16)
        vllm_request = vpb.GenerateRequest(request_id="flood", sampling_params=vllm_sampling)
        vllm_request.tokenized.input_ids.extend(ids)
        text = vpb.GenerateRequest(text="x").SerializeToString() if "text" in kind else b""
        return "/vllm.grpc.engine.VllmEngine/Generate", text + vllm_request.SerializeToString()
    if kind == "embed":
        embed = vpb.EmbedRequest(request_id="flood")
        embed.tokenized.input_ids.extend(ids)
        return "/vllm.grpc.engine.VllmEngine/Embed", embed.SerializeToString()
    if kind == "stop":
        stop = pb.SamplingOptions(max_tokens=1, stop=itertools.repeat("x", (14 << 20) // 3))
        body = pb.GenerateRequest(text="hi", sampling=stop).SerializeToString()
        return "/specserve.v1.Generation/GenerateComplete", body
    abort = vpb.AbortRequest(request_ids=(f"request-{i:07d}" for i in range(800_000)))
    return "/vllm.grpc.engine.VllmEngine/Abort", abort.SerializeToString()


def _gaps(times: list[float], start: float, end: float) -> list[float]:
    """The waits between two deltas that overlap [start, end]."""
    return [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]


def _p99(gaps: list[float]) -> float:
    return sorted(gaps)[int(0.99 * (len(gaps) - 1))]


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[2] not in KINDS:
        sys.exit(f"usage: prompt_flood.py HOST:PORT {'|'.join(KINDS)} [NUM_FLOODS]")
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) == 4 else 1)
