"""Floods of large request bodies against an in-process server, and the one bound on
health latency that the flood tests share.

Timing on a shared machine is noisy: a loaded 2-core runner slows everything, health
answers included. So the tests never compare with a fixed number of milliseconds. They
compare the slowest health answer during a flood with what is measured in the same run,
on the same machine, just before: the slowest health answer during a control flood of
as many bodies of the same size that the server refuses unparsed (what receiving the
bytes costs, on this machine, now), and how long protobuf takes to parse one of the
flood's bodies whole. A body parsed whole while the event loop waits (or while the
parsing thread holds the GIL) delays health by at least one such parse, and a burst of
them by several: that is the bug class these tests catch. The structural guarantees
(where a body is parsed, in pieces of what size) are tested without clocks
(test_body_policy.py, test_wire_pieces.py); the precise numbers are benchmarks
(scripts/prompt_flood.py, docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.client import SpecserveClient
from tests.server.helpers import REPO_ROOT, fastest_s, wait_until

NUM_BASELINE_PROBES = 30
# The least margin over the control flood: its slowest answer varies run to run.
MIN_MARGIN_S = 0.1
# A method that refuses a large body by its size, unparsed (body_policy.py).
CONTROL_METHOD = "/specserve.v1.Generation/GetModelInfo"


class HealthProbe(threading.Thread):
    """Calls health every 10 ms; records when each call started and how long it took."""

    def __init__(self, client: SpecserveClient) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.starts: list[float] = []
        self.latencies: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            assert self.client.health(timeout=30) == "SERVING"
            self.starts.append(t0)
            self.latencies.append(time.monotonic() - t0)
            time.sleep(0.01)

    def baseline(self) -> float:
        """The slowest of NUM_BASELINE_PROBES answers, the first few left out (the
        channel connects on the first call)."""
        wait_until(lambda: len(self.latencies) >= NUM_BASELINE_PROBES, 60, "a health baseline")
        return max(self.latencies[5:NUM_BASELINE_PROBES])

    def finish(self) -> None:
        self.stop.set()
        self.join(30)

    def slowest(self, start: float, end: float) -> tuple[float, int]:
        """(the slowest answer to the calls made in [start, end), how many there were)."""
        latencies = [lat for t, lat in zip(self.starts, self.latencies) if start <= t < end]
        return max(latencies, default=0.0), len(latencies)


def whole_parse_s(parse: Callable[[bytes], object], data: bytes) -> float:
    """How long ``parse(data)`` takes here and now: the fastest of three."""
    return fastest_s(lambda: parse(data))


def health_bound(baseline_s: float, work_s: float, control_s: float = 0.0) -> float:
    """The slowest health answer a flood may cause: twice the slowest answer without it
    or during the control flood, plus twice ``work_s`` (what one request of the flood
    costs done whole: a body's parse, a prompt's encoding) or MIN_MARGIN_S, whichever is
    more. Six bodies that protobuf parses whole, on the loop or holding the GIL, delayed
    health by 2-8 parses (measured on a 2-core machine: 0.13-0.83 s against 0.06-0.1 s
    a parse); refused unparsed or decoded in short pieces off the loop, about as much as
    the control flood."""
    return 2 * max(baseline_s, control_s) + max(2 * work_s, MIN_MARGIN_S)


@dataclass(frozen=True)
class Flood:
    health_s: float  # the slowest health answer to a call made during the flood
    num_answers: int  # health answers to calls made during it
    flood_s: float


def run_flood(probe: HealthProbe, sender: subprocess.Popen) -> Flood:
    """Start ``sender`` (raw_flood) and wait for every answer."""
    t0 = time.monotonic()
    sender.communicate("go\n", timeout=600)
    t1 = time.monotonic()
    assert sender.returncode == 0
    return Flood(*probe.slowest(t0, t1), t1 - t0)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """The objects alive now left out of garbage collection while the block runs. A full
    collection of this process's heap (torch, the model, the test run's objects) holds
    the GIL ~0.1 s and may land in any window: it would be measured as the flood's."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def raw_flood(
    target: str, method: str, data: bytes, count: int, tmp_path: Path
) -> Iterator[subprocess.Popen]:
    """A process ready to send ``data`` to ``method`` ``count`` times at once
    (raw_sender.py): ``run_flood`` starts it. Answers go to ``tmp_path``."""
    tmp_path.mkdir(exist_ok=True)
    body = tmp_path / "body"
    body.write_bytes(data)
    args = [target, method, str(body), str(tmp_path), str(count)]
    with subprocess.Popen(
        [sys.executable, "-m", "tests.server.raw_sender", *args],
        cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as sender:  # fmt: skip
        try:
            assert sender.stdout.readline() == "ready\n"
            yield sender
        finally:
            if sender.poll() is None:
                sender.kill()


def flood_answers(tmp_path: Path, count: int) -> list[tuple[str, bytes | str]]:
    """Each call's outcome as raw_sender wrote it: ("OK", the last response) or (the
    status code's name, its details)."""
    answers = []
    for i in range(count):
        error = tmp_path / f"error-{i}"
        if error.exists():
            code, details = error.read_text().split("\n", 1)
            answers.append((code, details))
        else:
            answers.append(("OK", (tmp_path / f"reply-{i}").read_bytes()))
    return answers
