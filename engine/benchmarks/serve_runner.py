"""The asyncio load generator of `specserve bench serve`: one streamed request per
BenchRequest, driven closed loop (N workers) or open loop (gamma-distributed arrivals).
The transport says how a request travels: a gRPC Generate here (GrpcTransport), or an
OpenAI HTTP stream (engine/benchmarks/serve_openai.py)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import grpc

from engine.benchmarks.serve_stats import Arrivals, RequestRecord
from engine.benchmarks.serve_workload import BenchRequest
from engine.client import AsyncSpecserveClient, build_request
from engine.rpc import generation_pb2 as pb


@dataclass(frozen=True)
class RequestOptions:
    """How every BenchRequest becomes a GenerateRequest."""

    temperature: float = 0.0
    ignore_eos: bool = True
    chat_template: bool = True
    num_speculative_tokens: int | None = None
    timeout_s: float | None = None

    def to_proto(self, req: BenchRequest) -> pb.GenerateRequest:
        common = dict(
            max_tokens=req.max_tokens,
            temperature=self.temperature,
            ignore_eos=self.ignore_eos,
            num_speculative_tokens=self.num_speculative_tokens,
        )
        if req.json_schema is not None:
            common["structured_output"] = {"json_schema": req.json_schema}
        if req.token_ids is not None:
            return build_request(list(req.token_ids), **common)
        if self.chat_template:
            return build_request(messages=req.messages(), **common)
        return build_request(req.plain_text, **common)


@dataclass(frozen=True)
class LoadShape:
    """Closed loop (`concurrency`) or open loop (`request_rate`), and when to stop."""

    concurrency: int | None = None
    request_rate: float | None = None
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_requests: int | None = None
    duration_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("give exactly one of --concurrency and --request-rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give --num-requests or --duration")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")

    @property
    def num_workers(self) -> int:
        """Closed-loop workers: the concurrency, capped by max_concurrency."""
        cap = self.max_concurrency or self.concurrency or 1
        return min(self.concurrency or 1, cap)


class Transport(Protocol):
    """How one BenchRequest travels: built before the clock starts, then streamed while
    it fills a RequestRecord (first_token, chunk_times/tokens, usage, end or error)."""

    def prepare(self, req: BenchRequest) -> object: ...

    async def fill(self, wire: object, record: RequestRecord, now: Callable[[], float]) -> None: ...


class LoadGenerator:
    """Sends requests through a transport; `run()` returns records and duration."""

    def __init__(self, transport: Transport, on_done=lambda record: None) -> None:
        self._transport = transport
        self._on_done = on_done
        self._t0 = 0.0
        self._duration_s: float | None = None

    async def run(
        self, requests: Iterator[BenchRequest], shape: LoadShape
    ) -> tuple[list[RequestRecord], float]:
        self._t0 = time.perf_counter()
        self._duration_s = shape.duration_s
        source = itertools.islice(requests, shape.num_requests)
        if shape.concurrency is not None:
            records = await self._closed_loop(source, shape.num_workers)
        else:
            records = await self._open_loop(source, shape)
        return sorted(records, key=lambda r: r.index), time.perf_counter() - self._t0

    def _admit(self) -> float | None:
        """The start time of a request made now, or None once the run's duration is
        over (one clock reading for both: a request is never recorded as starting after
        the duration it was admitted within)."""
        now = self._now()
        return None if self._duration_s is not None and now >= self._duration_s else now

    async def _closed_loop(self, source: Iterator[BenchRequest], num_workers: int):
        records: list[RequestRecord] = []

        async def worker() -> None:
            for req in source:  # a shared iterator: each request goes to one worker
                start = self._admit()
                if start is None:
                    return
                records.append(await self.send(req, start))

        await asyncio.gather(*(worker() for _ in range(num_workers)))
        return records

    async def _open_loop(self, source: Iterator[BenchRequest], shape: LoadShape):
        arrivals = Arrivals(shape.request_rate, shape.burstiness, shape.seed)
        cap = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None
        tasks = []
        next_arrival = time.perf_counter()
        for req in source:
            await asyncio.sleep(max(0.0, next_arrival - time.perf_counter()))
            if self._admit() is None:  # arrivals end with the duration
                break
            tasks.append(asyncio.create_task(self._send_capped(req, cap)))
            next_arrival += arrivals.next_gap()
        return list(await asyncio.gather(*tasks))

    async def _send_capped(self, req: BenchRequest, cap: asyncio.Semaphore | None):
        async with cap if cap is not None else contextlib.nullcontext():
            return await self.send(req)

    async def send(self, req: BenchRequest, start: float | None = None) -> RequestRecord:
        """One streamed request; the clock starts when the call is made (or at
        ``start``, when it was admitted)."""
        start = self._now() if start is None else start
        wire = self._transport.prepare(req)
        record = RequestRecord(req.index, start, req.num_prompt_tokens or 0)
        record.json_schema = req.json_schema
        await self._transport.fill(wire, record, self._now)
        self._on_done(record)
        return record

    def _now(self) -> float:
        return time.perf_counter() - self._t0


class GrpcTransport:
    """One streamed Generate per request, round-robin over the clients (channels)."""

    def __init__(self, clients: list[AsyncSpecserveClient], options: RequestOptions) -> None:
        self._clients = itertools.cycle(clients)
        self._options = options

    def prepare(self, req: BenchRequest) -> pb.GenerateRequest:
        return self._options.to_proto(req)

    async def fill(
        self, wire: pb.GenerateRequest, record: RequestRecord, now: Callable[[], float]
    ) -> None:
        try:
            stream = next(self._clients).generate(request=wire, timeout=self._options.timeout_s)
            async for delta in stream:
                _observe(record, delta, now())
            record.end = now()
            if record.finish_reason == "abort":
                record.error = "FINISH_ABORT"
        except grpc.RpcError as exc:
            record.error = exc.code().name


def _observe(record: RequestRecord, delta, now: float) -> None:
    if delta.token_ids:
        if record.first_token is None:
            record.first_token = now
        record.chunk_times.append(now)
        record.chunk_tokens.append(len(delta.token_ids))
    if delta.usage is not None:
        record.num_prompt_tokens = delta.usage.prompt_tokens
        record.num_draft_tokens = delta.usage.draft_tokens
        record.num_accepted_tokens = delta.usage.accepted_draft_tokens
    if delta.finish_reason is not None:
        record.finish_reason = delta.finish_reason
    if record.json_schema is not None:
        record.text.append(delta.text)


def make_clients(
    server: str, num_channels: int, api_key: str | None, tls
) -> list[AsyncSpecserveClient]:
    """`num_channels` separate connections to each of the comma-separated servers,
    interleaved so round-robin takes turns between servers (a local subchannel pool
    stops gRPC from sharing one TCP connection between channels to the same target)."""
    targets = [t.strip() for t in server.split(",") if t.strip()]
    options = [("grpc.use_local_subchannel_pool", 1)] if num_channels > 1 else []
    return [
        AsyncSpecserveClient(target, api_key=api_key, tls=tls, options=options)
        for _ in range(num_channels)
        for target in targets
    ]
