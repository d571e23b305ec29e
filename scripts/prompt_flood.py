"""Huge prompts against a running server: does another stream stall, does health lag?

    .venv/bin/specserve serve --port 50099 &
    .venv/bin/python scripts/prompt_flood.py localhost:50099 text   # or: chat

One greedy stream runs; after 20 s of baseline, 20 requests with a 522k-character
prompt arrive at once (text, or one chat message). Prints the stream's longest and
99th-percentile wait between deltas before and during the flood (a longer window sees
a larger maximum by chance alone, hence the percentile), how long the flood took, and
the slowest health answer (polled every 20 ms) during it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.client import SpecserveClient  # noqa: E402

NUM_PROMPTS = 20
PROMPT_CHARS = 522_000
BASELINE_S = 20.0


def main(target: str, kind: str) -> None:
    client = SpecserveClient(target)
    client.wait_serving(300)
    times: list[float] = []
    threading.Thread(target=_stream, args=(client, times), daemon=True).start()
    time.sleep(BASELINE_S)
    baseline_end = time.monotonic()
    latencies: list[float] = []
    done = threading.Event()
    threading.Thread(target=_poll_health, args=(client, latencies, done), daemon=True).start()
    text = ("The quick brown fox jumps over the lazy dog. " * 12000)[:PROMPT_CHARS]
    flood = [threading.Thread(target=_big, args=(client, text, kind)) for _ in range(NUM_PROMPTS)]
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


def _big(client: SpecserveClient, text: str, kind: str) -> None:
    prompt = {"messages": [{"role": "user", "content": text}]} if kind == "chat" else {}
    with contextlib.suppress(grpc.RpcError):  # refused as too long for the context
        client.generate_complete(None if prompt else text, max_tokens=1, **prompt)


def _gaps(times: list[float], start: float, end: float) -> list[float]:
    """The waits between two deltas that overlap [start, end]."""
    return [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]


def _p99(gaps: list[float]) -> float:
    return sorted(gaps)[int(0.99 * (len(gaps) - 1))]


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in ("text", "chat"):
        sys.exit("usage: prompt_flood.py HOST:PORT text|chat")
    main(sys.argv[1], sys.argv[2])
