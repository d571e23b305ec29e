"""The vllm.grpc.engine.VllmEngine servicer (PyPI smg-grpc-proto): what the Shepherd
Model Gateway (smg) calls on a ``--backend vllm`` worker.

It shares the server, AsyncEngine, auth, TLS, admission, drain and error reporting with
specserve.v1.Generation: every handler runs inside the same ``RpcGuard``. Only Generate
is admitted work (refused while draining, waited for at shutdown); the rest are
metadata, control or long-lived subscriptions. See docs/grpc.md for the semantics.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from engine import version
from engine.core.async_engine import Reservation
from engine.io.sampling_params import SamplingParams
from engine.server import vllm_convert, vllm_tokenizer
from engine.server.auth import caller_id
from engine.server.rpc_guard import RETRY_AFTER_KEY, RpcError, RpcGuard, ready_engine
from engine.server.validation import InvalidArgument, ModelLimits
from engine.server.vllm_kv_events import CursorOutOfRange, KvEventHub
from engine.server.vllm_loads import LoadRecords, LoadTracker, scheduler_load
from engine.server.vllm_request import MAX_CHOICES, VllmRequest, to_vllm_request

SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
MAX_ABORT_IDS = 1024
FLUSH_RETRY_S = 0.1
LOAD_TICK_S = 0.1  # how often an idle KV-event stream checks its record and the drain


class VllmEngineServicer(vpb_grpc.VllmEngineServicer):
    def __init__(self, engine: Any, guard: RpcGuard, kv_events: KvEventHub) -> None:
        self._engine = engine
        self._guard = guard
        self._lifecycle = guard.lifecycle
        self._kv_events = kv_events
        self._loads = LoadTracker(engine)
        self._tokenizer = vllm_tokenizer.TokenizerBundle(engine)
        self._start_time = time.time()
        self._last_receive_time = 0.0

    # ---- RPCs --------------------------------------------------------------------
    async def Generate(self, request: vpb.GenerateRequest, context: grpc.aio.ServicerContext):
        request_id = request.request_id[:128] or None
        await self._guard.run(context, self._generate, request, context, request_id=request_id)

    async def Embed(self, request: vpb.EmbedRequest, context: grpc.aio.ServicerContext):
        return await self._guard.run(context, self._unimplemented, "Embed", admit=False)

    async def HealthCheck(self, request, context: grpc.aio.ServicerContext):
        return await self._guard.run(context, self._health, admit=False)

    async def FlushCache(self, request: cpb.FlushCacheRequest, context: grpc.aio.ServicerContext):
        return await self._guard.run(context, self._flush_cache, request, context, admit=False)

    async def StartProfile(self, request, context: grpc.aio.ServicerContext):
        return await self._guard.run(context, self._unimplemented, "StartProfile", admit=False)

    async def StopProfile(self, request, context: grpc.aio.ServicerContext):
        return await self._guard.run(context, self._unimplemented, "StopProfile", admit=False)

    async def Abort(self, request: vpb.AbortRequest, context: grpc.aio.ServicerContext):
        return await self._guard.run(context, self._abort, request, admit=False)

    async def GetModelInfo(self, request, context: grpc.aio.ServicerContext):
        return await self._guard.run(context, self._model_info, admit=False)

    async def GetServerInfo(self, request, context: grpc.aio.ServicerContext):
        return await self._guard.run(context, self._server_info, admit=False)

    async def GetLoads(self, request: vpb.GetLoadsRequest, context: grpc.aio.ServicerContext):
        return await self._guard.run(context, self._get_loads, admit=False)

    async def GetTokenizer(self, request, context: grpc.aio.ServicerContext):
        await self._guard.run(context, self._get_tokenizer, context, admit=False)

    async def SubscribeKvEvents(
        self, request: cpb.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ):
        await self._guard.run(context, self._subscribe, request, context, admit=False)

    # ---- Generate ------------------------------------------------------------------
    async def _generate(self, request: vpb.GenerateRequest, context: grpc.aio.ServicerContext):
        self._last_receive_time = time.time()
        engine = ready_engine(self._engine)
        limits = ModelLimits.from_model_info(engine.model_info)
        req = to_vllm_request(request, limits, self._max_choices(engine))
        _check_room(engine, req.num_choices)
        # Every choice is admitted under the label before the first await: an Abort from
        # now on (by the same caller) ends them all, even while the text waits for the
        # encoder.
        reservation = engine.reserve(req.label, req.num_choices, owner=caller_id())
        with contextlib.closing(reservation):
            await self._run(engine, reservation, req, limits, context)

    async def _run(
        self,
        engine: Any,
        reservation: Reservation,
        req: VllmRequest,
        limits: ModelLimits,
        context: grpc.aio.ServicerContext,
    ) -> None:
        prompt_ids = req.prompt_ids
        if prompt_ids is None:
            prompt_ids = await reservation.unless_aborted(self._tokenize(engine, req, limits))
            if prompt_ids is None:  # aborted before its text was encoded: nothing ran
                for index in range(req.num_choices):
                    await context.write(vllm_convert.aborted(index))
                return
        prompt_ids = req.prompt(prompt_ids, limits)
        params = req.sampling_params(len(prompt_ids), limits)
        eos_ids = frozenset(engine.model_info.get("eos_token_ids") or ())
        choices = [vllm_convert.ChoiceState(i) for i in range(len(params))]
        async with contextlib.aclosing(_outputs(reservation, prompt_ids, params)) as outputs:
            async for index, output in outputs:
                choice = choices[index]
                choice.add(output)
                if req.stream and output.token_ids:
                    await context.write(vllm_convert.chunk(output, index, req.logprobs))
                if output.finished:
                    complete = vllm_convert.complete(choice, req.logprobs, eos_ids, req.stream)
                    await context.write(complete)

    async def _tokenize(self, engine: Any, req: VllmRequest, limits: ModelLimits) -> list[int]:
        # The engine's own encoder, off this loop; bounded unless the request truncates.
        max_tokens = None if req.truncate_prompt_tokens else limits.max_model_len - 1
        try:
            return await engine.tokenize(req.text, max_tokens=max_tokens)
        except ValueError as exc:
            raise InvalidArgument(f"text: {exc}") from None

    @staticmethod
    def _max_choices(engine: Any) -> int:
        return max(1, min(MAX_CHOICES, engine.max_in_flight))

    # ---- the rest ------------------------------------------------------------------
    async def _unimplemented(self, name: str) -> None:
        reasons = {
            "Embed": "Embed is not supported: this server serves generation models only",
            "StartProfile": "StartProfile is not supported by this server",
            "StopProfile": "StopProfile is not supported by this server",
        }
        raise RpcError(grpc.StatusCode.UNIMPLEMENTED, reasons[name])

    async def _health(self) -> vpb.HealthCheckResponse:
        engine = self._engine
        if engine.dead_error is not None:
            return vpb.HealthCheckResponse(healthy=False, message="engine failed")
        if self._lifecycle.draining or not engine.is_healthy:
            return vpb.HealthCheckResponse(healthy=False, message="shutting down")
        if not engine.is_ready:
            return vpb.HealthCheckResponse(healthy=False, message="loading the model")
        return vpb.HealthCheckResponse(healthy=True, message="Health")

    async def _flush_cache(
        self, request: cpb.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> cpb.FlushCacheResponse:
        """Drop every cached block no request holds; with ``timeout_s`` > 0, retry until
        requests holding cached blocks are gone or the time is up."""
        timeout_s = request.timeout_s
        if not math.isfinite(timeout_s) or timeout_s < 0:
            raise InvalidArgument(f"timeout_s must be a finite number >= 0, got {timeout_s}")
        remaining = context.time_remaining()
        if remaining is not None:
            timeout_s = min(timeout_s, remaining)
        engine = ready_engine(self._engine)
        deadline = time.monotonic() + timeout_s
        num_dropped = 0
        while True:
            dropped, num_held = await engine.reset_prefix_cache()
            num_dropped += dropped
            if num_held == 0:
                return cpb.FlushCacheResponse(
                    success=True, message=f"prefix cache flushed: {num_dropped} blocks dropped"
                )
            if time.monotonic() + FLUSH_RETRY_S > deadline:
                return cpb.FlushCacheResponse(
                    success=False,
                    message=f"{num_dropped} blocks dropped; {num_held} cached blocks are "
                    "held by running requests and stay cached",
                )
            await asyncio.sleep(FLUSH_RETRY_S)

    async def _abort(self, request: vpb.AbortRequest) -> vpb.AbortResponse:
        if len(request.request_ids) > MAX_ABORT_IDS:
            raise InvalidArgument(
                f"request_ids must have at most {MAX_ABORT_IDS} ids, got {len(request.request_ids)}"
            )
        owner = caller_id()  # labels are the caller's: another key's requests are not seen
        for request_id in request.request_ids:
            await self._engine.abort(request_id, owner=owner)  # unknown ids: nothing to do
        return vpb.AbortResponse()

    async def _model_info(self) -> vpb.GetModelInfoResponse:
        return vllm_convert.model_info(ready_engine(self._engine).model_info)

    async def _server_info(self) -> vpb.GetServerInfoResponse:
        engine = ready_engine(self._engine)
        return vllm_convert.server_info(
            engine.model_info, engine.num_in_flight, self._start_time, self._last_receive_time
        )

    async def _get_loads(self) -> vpb.GetLoadsResponse:
        ready_engine(self._engine)
        return vpb.GetLoadsResponse(
            timestamp=datetime.now(timezone.utc).isoformat(),
            version=version(),
            dp_rank_count=1,
            loads=[scheduler_load(self._loads.figures())],
        )

    async def _get_tokenizer(self, context: grpc.aio.ServicerContext) -> None:
        ready_engine(self._engine)
        data, sha256 = await self._tokenizer.archive()
        for piece in vllm_tokenizer.chunks(data, sha256):
            await context.write(piece)

    # ---- SubscribeKvEvents ---------------------------------------------------------
    async def _subscribe(
        self, request: cpb.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """A snapshot (start 0) or the history from ``start_sequence_number``, then live
        batches, each with the load record; heartbeats while the engine is quiet. Ends
        (OK) when the server drains."""
        if self._lifecycle.draining:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        ready_engine(self._engine)
        hub = self._kv_events
        records = LoadRecords(self._loads)
        start = request.start_sequence_number
        try:
            batches = hub.snapshot() if start == 0 else hub.resume(start)
        except CursorOutOfRange as exc:
            raise RpcError(grpc.StatusCode.OUT_OF_RANGE, str(exc)) from None
        cursor = hub.sequence_number  # what the batches above reach (no await between)
        for batch in batches:
            await context.write(records.stamp(batch))
        while not self._lifecycle.draining:
            await hub.wait(cursor, LOAD_TICK_S)
            if hub.sequence_number > cursor:
                batches = hub.batches_after(cursor)
                if batches is None:  # fell behind the history: the state instead
                    batches = hub.snapshot(after=cursor)
                cursor = hub.sequence_number
                for batch in batches:
                    await context.write(records.stamp(batch))
            else:
                heartbeat = records.heartbeat(cursor)
                if heartbeat is not None:
                    await context.write(heartbeat)


def _check_room(engine: Any, num_choices: int) -> None:
    """All n choices or none: a stream must not end RESOURCE_EXHAUSTED half way through
    (AsyncEngine.reserve admits them together; this refusal names n and the room)."""
    num_free = engine.max_in_flight - engine.num_in_flight
    if num_choices > 1 and num_choices > num_free:
        raise RpcError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"engine overloaded: sampling_params.n = {num_choices} needs as many request "
            f"slots and {max(num_free, 0)} of {engine.max_in_flight} are free; retry later",
            ((RETRY_AFTER_KEY, "1000"),),
        )


async def _outputs(
    reservation: Reservation, prompt_ids: list[int], params: list[SamplingParams]
) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, output delta) of every choice, as they come. Leaving early (or an
    error in any choice) closes every engine iterator, which aborts its request."""
    if len(params) == 1:
        generate = reservation.generate(0, prompt_ids, params[0])
        async with contextlib.aclosing(generate) as outputs:
            async for output in outputs:
                yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, choice_params: SamplingParams) -> None:
        try:
            async with contextlib.aclosing(
                reservation.generate(index, prompt_ids, choice_params)
            ) as outputs:
                async for output in outputs:
                    queue.put_nowait((index, output))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, raised there
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(params)]
    try:
        num_finished = 0
        while num_finished < len(params):
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            num_finished += item[1].finished
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
