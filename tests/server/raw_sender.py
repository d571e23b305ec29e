"""Sending serialized request bodies as they are, from this process or another one.

``python -m tests.server.raw_sender TARGET METHOD BODY OUT COUNT`` connects, prints
"ready", and when a line arrives on stdin sends the file BODY COUNT times at once,
writing each call's last response to OUT/reply-<i>. A flood sent from a process of its
own, as clients do, leaves the server's interpreter to the server: sender threads in it
compete for the GIL with the event loop being measured.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc


def send_raw(channel: grpc.Channel, method: str, data: bytes) -> bytes:
    """``data`` sent as it is, not serialized again; the last response, serialized."""
    if method.endswith("VllmEngine/Generate"):
        return list(channel.unary_stream(method)(data, timeout=60))[-1]
    return channel.unary_unary(method)(data, timeout=60)


def main(target: str, method: str, body: str, out: str, count: str) -> None:
    data = Path(body).read_bytes()
    with grpc.insecure_channel(target) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        print("ready", flush=True)
        sys.stdin.readline()
        with ThreadPoolExecutor(int(count)) as pool:
            replies = pool.map(lambda _: send_raw(channel, method, data), range(int(count)))
            for i, reply in enumerate(replies):
                (Path(out) / f"reply-{i}").write_bytes(reply)


if __name__ == "__main__":
    main(*sys.argv[1:])
