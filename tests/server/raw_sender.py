"""Sending serialized request bodies as they are, from this process or another one.

``python -m tests.server.raw_sender TARGET METHOD BODY OUT COUNT`` connects, prints
"ready", and when a line arrives on stdin sends the file BODY COUNT times at once,
writing each call's last response to OUT/reply-<i>, or its status code and details
(two lines) to OUT/error-<i> when the call fails. A flood sent from a process of its
own, as clients do, leaves the server's interpreter to the server: sender threads in it
compete for the GIL with the event loop being measured.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

# Methods whose responses stream; every other one answers once.
STREAMING_METHODS = ("/specserve.v1.Generation/Generate", "/vllm.grpc.engine.VllmEngine/Generate")


def send_raw(channel: grpc.Channel, method: str, data: bytes) -> bytes:
    """``data`` sent as it is, not serialized again; the last response, serialized."""
    if method in STREAMING_METHODS:
        return list(channel.unary_stream(method)(data, timeout=60))[-1]
    return channel.unary_unary(method)(data, timeout=60)


def _send_and_record(channel: grpc.Channel, method: str, data: bytes, out: Path, i: int) -> None:
    try:
        (out / f"reply-{i}").write_bytes(send_raw(channel, method, data))
    except grpc.RpcError as exc:
        (out / f"error-{i}").write_text(f"{exc.code().name}\n{exc.details()}")


def main(target: str, method: str, body: str, out: str, count: str) -> None:
    data = Path(body).read_bytes()
    with grpc.insecure_channel(target) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        print("ready", flush=True)
        sys.stdin.readline()
        with ThreadPoolExecutor(int(count)) as pool:
            calls = [pool.submit(_send_and_record, channel, method, data, Path(out), i)
                     for i in range(int(count))]  # fmt: skip
            for call in calls:
                call.result()


if __name__ == "__main__":
    main(*sys.argv[1:])
