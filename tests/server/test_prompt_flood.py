"""Huge prompts are encoded off the engine thread and off the event loop: a flood of
them neither stalls another stream nor delays health answers. Huge token-id prompts
that ask for truncation are cut before any per-id work."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from engine.client import SpecserveClient
from engine.config import EngineConfig
from engine.rpc import generation_pb2 as pb
from tests.server.helpers import InProcessServer, wait_until

MAX_MODEL_LEN = 32768
NUM_TEXT_PROMPTS = 10
NUM_CHAT_PROMPTS = 10


@pytest.fixture(scope="module")
def long_context_server(tiny_model_factory):
    """The tiny model with a 32k context: its character cap (32768 x 13, the longest
    token) lets 426k-character prompts reach the tokenizer, about 0.2 s each."""
    model = tiny_model_factory(max_position_embeddings=MAX_MODEL_LEN)
    config = EngineConfig(
        model=model, device="cpu", speculative_method="none", num_kv_blocks=MAX_MODEL_LEN // 16 + 1
    )
    with InProcessServer(config) as srv:
        yield srv


class _Stream(threading.Thread):
    """A long greedy stream; records when each delta arrived."""

    def __init__(self, client: SpecserveClient) -> None:
        super().__init__(daemon=True)
        self.call = client.generate([5, 6], max_tokens=MAX_MODEL_LEN - 8, ignore_eos=True,
                                    temperature=0.0)  # fmt: skip
        self.times: list[float] = []

    def run(self) -> None:
        try:
            for _ in self.call:
                self.times.append(time.monotonic())
        except grpc.RpcError:
            pass  # cancelled at the end

    def max_gap(self, start: float, end: float) -> float:
        """The longest wait between two deltas that overlaps [start, end]."""
        times = list(self.times)
        return max(b - a for a, b in zip(times, times[1:]) if b >= start and a <= end)


class _HealthProbe(threading.Thread):
    def __init__(self, client: SpecserveClient) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.latencies: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            assert self.client.health(timeout=10) == "SERVING"
            self.latencies.append(time.monotonic() - t0)
            time.sleep(0.01)


def _huge_prompt(
    client: SpecserveClient, i: int, chars: int, start: threading.Barrier, codes: list
) -> None:
    text = "x" * chars
    start.wait(30)
    try:
        if i < NUM_TEXT_PROMPTS:
            client.generate_complete(text, max_tokens=1)
        else:
            client.generate_complete(messages=[{"role": "user", "content": text}], max_tokens=1)
    except grpc.RpcError as exc:
        codes.append(exc.code())


def test_a_flood_of_huge_prompts_stalls_neither_streams_nor_health(long_context_server):
    srv = long_context_server
    with SpecserveClient(srv.target) as client:
        chars = MAX_MODEL_LEN * 13  # at the character cap: refused only after encoding
        stream = _Stream(client)
        stream.start()
        wait_until(lambda: len(stream.times) >= 20, 30, "the stream to start")
        probe = _HealthProbe(client)
        probe.start()
        t0 = time.monotonic()
        wait_until(lambda: time.monotonic() - t0 > 1.0, 5, "a baseline second")
        t1 = time.monotonic()
        baseline_gap = stream.max_gap(t0, t1)
        baseline_health = max(probe.latencies)
        codes: list[grpc.StatusCode] = []
        num_prompts = NUM_TEXT_PROMPTS + NUM_CHAT_PROMPTS
        start = threading.Barrier(num_prompts)  # all at once, as a burst arrives
        flood = [
            threading.Thread(target=_huge_prompt, args=(client, i, chars, start, codes))
            for i in range(num_prompts)
        ]
        num_health = len(probe.latencies)
        for thread in flood:
            thread.start()
        for thread in flood:
            thread.join(120)
        t2 = time.monotonic()
        probe.stop.set()
        probe.join(10)
        wait_until(lambda: stream.times[-1] > t2, 30, "a delta after the flood")
        stream.call.cancel()
        assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * len(flood)
        flood_gap = stream.max_gap(t1, t2)
        flood_health = max(probe.latencies[num_health:])
        print(f"gap {baseline_gap:.3f} -> {flood_gap:.3f} s; health {baseline_health:.3f} "
              f"-> {flood_health:.3f} s; flood {t2 - t1:.2f} s")  # fmt: skip
        # Generous bounds for a shared 2-core machine (measured here: gap 6 -> 60 ms,
        # health under 50 ms). Encoding on the engine thread stalled the stream for
        # most of the flood (0.8 s), on the event loop it delayed health by 0.4 s.
        assert flood_gap < 3 * baseline_gap + 0.3
        assert flood_health < 0.2


# ---- huge token-id prompts that ask for truncation -----------------------------------

NUM_HUGE = 6
HUGE_IDS = 15_000_000  # about 14 MiB on the wire, under the 16 MiB message cap
KEPT = list(range(3, 19))  # the last ids of every huge prompt: what truncation keeps
OUT_OF_VOCAB = 1000


@dataclasses.dataclass
class _Huge:
    """One service's huge request, serialized once (15M ids take a second to build)."""

    method: str
    data: bytes
    bad_tail: bytes  # appended to data: one more id, out of the vocabulary
    field: str  # the prompt's field, as refusals name it
    answer: Callable[[bytes], tuple[int, list[int]]]  # (prompt tokens, output ids)


def _huge_ids() -> Iterator[int]:
    return itertools.chain(itertools.repeat(5, HUGE_IDS - len(KEPT)), KEPT)


def _specserve_huge() -> _Huge:
    sampling = pb.SamplingOptions(
        max_tokens=4, temperature=0.0, ignore_eos=True, truncate_prompt_tokens=len(KEPT)
    )
    request = pb.GenerateRequest(sampling=sampling)
    request.token_ids.ids.extend(_huge_ids())

    def answer(data: bytes) -> tuple[int, list[int]]:
        reply = pb.GenerateCompleteResponse.FromString(data)
        return reply.usage.prompt_tokens, list(reply.token_ids)

    # Serialized messages concatenate as a merge: repeated fields append.
    bad_tail = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[OUT_OF_VOCAB]))
    return _Huge(
        "/specserve.v1.Generation/GenerateComplete",
        request.SerializeToString(),
        bad_tail.SerializeToString(),
        "token_ids.ids",
        answer,
    )


def _vllm_huge() -> _Huge:
    sampling = vpb.SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True, truncate_prompt_tokens=len(KEPT)
    )
    request = vpb.GenerateRequest(request_id="huge", sampling_params=sampling)
    request.tokenized.input_ids.extend(_huge_ids())

    def answer(data: bytes) -> tuple[int, list[int]]:
        complete = vpb.GenerateResponse.FromString(data).complete
        return complete.prompt_tokens, list(complete.output_ids)

    bad_tail = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[OUT_OF_VOCAB]))
    return _Huge(
        "/vllm.grpc.engine.VllmEngine/Generate",
        request.SerializeToString(),
        bad_tail.SerializeToString(),
        "tokenized.input_ids",
        answer,
    )


HUGE_REQUESTS = {"specserve.v1": _specserve_huge, "VllmEngine": _vllm_huge}


def _send_raw(channel: grpc.Channel, method: str, data: bytes) -> bytes:
    """``data`` sent as it is, not serialized again; the last response, serialized."""
    if method.endswith("VllmEngine/Generate"):
        return list(channel.unary_stream(method)(data, timeout=60))[-1]
    return channel.unary_unary(method)(data, timeout=60)


@pytest.mark.parametrize("service", sorted(HUGE_REQUESTS))
def test_huge_truncated_id_prompts_stall_nothing(long_context_server, service):
    """Six requests of 15M token ids with truncate_prompt_tokens 16 at once: each is
    answered as its last 16 ids alone, and health keeps answering."""
    srv = long_context_server
    huge = HUGE_REQUESTS[service]()
    with SpecserveClient(srv.target) as client, grpc.insecure_channel(srv.target) as channel:
        expected = client.generate_complete(KEPT, max_tokens=4, temperature=0.0, ignore_eos=True)
        probe = _HealthProbe(client)
        probe.start()
        wait_until(lambda: len(probe.latencies) >= 20, 30, "a health baseline")
        num_baseline = len(probe.latencies)
        t0 = time.monotonic()
        with ThreadPoolExecutor(NUM_HUGE) as pool:
            send = lambda _: _send_raw(channel, huge.method, huge.data)  # noqa: E731
            replies = list(pool.map(send, range(NUM_HUGE)))
        flood_s = time.monotonic() - t0
        probe.stop.set()
        probe.join(10)
        assert [huge.answer(r) for r in replies] == [(len(KEPT), expected.token_ids)] * NUM_HUGE
        baseline_health = max(probe.latencies[:num_baseline])
        flood_health = max(probe.latencies[num_baseline:], default=flood_s)
        print(f"{service}: health {baseline_health:.3f} -> {flood_health:.3f} s; "
              f"flood {flood_s:.2f} s")  # fmt: skip
        # Measured on a shared 2-core machine: when every id was read on the event loop
        # (1.2-1.5 s a request) the flood took 6.7-11 s and health waited 2.7-6.4 s;
        # now 0.7-1.6 s and 0.25-1.0 s. What is left is grpc parsing each 14 MiB body
        # on the loop (0.1-0.2 s, before any handler runs), the same as for untruncated
        # lists, which are refused for their length.
        assert flood_s < 4.0
        assert flood_health < 2.0
        # The ids kept are still range-checked.
        with pytest.raises(grpc.RpcError) as info:
            _send_raw(channel, huge.method, huge.data + huge.bad_tail)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(f"{huge.field} must be in [0, ")
