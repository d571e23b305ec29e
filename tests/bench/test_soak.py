"""Soak: hundreds of concurrent streams with random cancellations, deadlines and bad
requests against a real server process, round after round. Off by default:

    pytest tests/bench --soak

At the end: no KV block is allocated, no request is running or waiting, the server's
RSS has not grown past a warm-up baseline (with a tolerance), and every stream that
completed produced the server's own greedy output for its prompt.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from engine.client import AsyncSpecserveClient, SpecserveClient, build_request
from tests.bench.conftest import BenchServer
from tests.server.helpers import wait_until

pytestmark = pytest.mark.soak

NUM_STREAMS = 300  # per round, all in flight together
NUM_ROUNDS = 10  # the first is the warm-up that sets the memory baseline
ROUND_TIMEOUT_S = 120
MAX_TOKENS = 16
RSS_TOLERANCE_MIB = 64
PROMPTS = [
    "The capital of France is",
    "Once upon a time there was a",
    "1, 2, 3, 4, 5, 6,",
    "Speculative decoding drafts tokens and",
    "a b c a b c a b c",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "Hello",
    "In the beginning the universe was created. This has made a lot of people",
]
# Each bad request must be refused with INVALID_ARGUMENT before it reaches the engine.
BAD_REQUESTS = [
    {"prompt": "x", "max_tokens": 0},
    {"prompt": "x", "temperature": -1.0},
    {"prompt": [10**6]},
    {"prompt": "x", "top_p": 0.0},
    {"prompt": "x", "num_speculative_tokens": 65},
]


def greedy(prompt) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class Soak:
    def __init__(self, clients: list[AsyncSpecserveClient], reference: dict[str, list[int]]):
        self.clients = clients
        self.reference = reference
        self.outcomes: Counter[str] = Counter()
        self.wrong: list[str] = []

    async def round(self, rng: random.Random) -> None:
        kinds = rng.choices(["complete", "cancel", "deadline", "bad"], [5, 2, 2, 1], k=NUM_STREAMS)
        streams = [self.stream(kind, rng.randrange(1 << 30)) for kind in kinds]
        await asyncio.wait_for(asyncio.gather(*streams), ROUND_TIMEOUT_S)

    async def stream(self, kind: str, seed: int) -> None:
        rng = random.Random(seed)
        prompt = rng.choice(PROMPTS)
        kwargs = rng.choice(BAD_REQUESTS) if kind == "bad" else greedy(prompt)
        timeout = rng.uniform(0.01, 1.0) if kind == "deadline" else 60.0
        cancel_after = rng.randrange(3) if kind == "cancel" else None
        await asyncio.sleep(rng.uniform(0, 0.5))  # staggered arrivals
        call = self.clients[seed % len(self.clients)].generate(
            request=build_request(**kwargs), timeout=timeout)  # fmt: skip
        token_ids: list[int] = []
        try:
            async for delta in call:
                token_ids += delta.token_ids
                if cancel_after is not None and len(token_ids) > cancel_after:
                    call.cancel()
        except grpc.RpcError as exc:
            self.outcomes[f"{kind}:{exc.code().name}"] += 1
            if kind == "bad" and exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                self.wrong.append(f"bad request {kwargs}: {exc.code().name}")
            return
        except asyncio.CancelledError:  # grpc.aio may surface a local cancel this way
            self.outcomes[f"{kind}:CANCELLED"] += 1
            return
        self.outcomes[f"{kind}:OK"] += 1
        if kind == "bad":
            self.wrong.append(f"bad request {kwargs} was accepted")
        elif token_ids != self.reference[prompt]:
            self.wrong.append(f"{prompt!r}: {token_ids} != {self.reference[prompt]}")


def assert_idle(client: SpecserveClient) -> None:
    def idle() -> bool:
        s = client.server_stats(timeout=5)
        return (s.target_pool.num_blocks_in_use, s.num_running, s.num_waiting,
                s.num_in_flight) == (0, 0, 0, 0)  # fmt: skip

    wait_until(idle, 20, "no blocks in use, nothing running, waiting or in flight")


@pytest.fixture(scope="module")
def soak_server(tiny_model_dir):
    server = BenchServer(Path(tiny_model_dir)).start_serving()
    yield server
    server.kill()


def test_soak(soak_server: BenchServer):
    with SpecserveClient(soak_server.target) as client:
        # The reference: each prompt alone, the same greedy parameters, same server.
        reference = {
            p: client.generate_complete(request=build_request(**greedy(p)), timeout=60).token_ids
            for p in PROMPTS
        }
        outcomes, baseline_mib, started = asyncio.run(run_rounds(soak_server, client, reference))
        assert_idle(client)
    final_mib = rss_mib(soak_server.pid)
    print(f"soak: {dict(outcomes)}; RSS {baseline_mib:.0f} -> {final_mib:.0f} MiB; "
          f"{time.monotonic() - started:.0f} s")  # fmt: skip
    assert final_mib <= baseline_mib + RSS_TOLERANCE_MIB
    assert outcomes.total() == NUM_STREAMS * NUM_ROUNDS
    for kind in ("complete:OK", "cancel:CANCELLED", "deadline:DEADLINE_EXCEEDED"):
        assert outcomes[kind] > 0, (kind, outcomes)


async def run_rounds(server: BenchServer, client: SpecserveClient, reference):
    started = time.monotonic()
    rng = random.Random(2024)
    clients = [AsyncSpecserveClient(server.target, options=[("grpc.use_local_subchannel_pool", 1)])
               for _ in range(4)]  # fmt: skip
    soak = Soak(clients, reference)
    baseline_mib = 0.0
    try:
        for i in range(NUM_ROUNDS):
            await soak.round(rng)
            assert not soak.wrong, soak.wrong[:5]
            await asyncio.to_thread(assert_idle, client)
            if i == 0:
                baseline_mib = rss_mib(server.pid)
    finally:
        for c in clients:
            await c.close()
    return soak.outcomes, baseline_mib, started
