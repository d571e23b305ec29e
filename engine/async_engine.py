"""AsyncEngine: the engine loop in a background thread, requests as async iterators.

The loop thread owns the LLMEngine (model, KV cache, scheduler, tokenizer for
detokenization). The asyncio side talks to it only through a command queue (add /
abort) and per-request output queues filled with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineShutdownError,
)
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


@dataclass(slots=True)
class _AddCommand:
    request_id: str
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    params: SamplingParams
    priority: int
    stream: _RequestStream


@dataclass(slots=True)
class _AbortCommand:
    request_id: str


class _RequestStream:
    """Per-request output queue; items are RequestOutput or an exception to raise."""

    __slots__ = ("request_id", "queue", "loop", "finished")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.loop = loop
        self.finished = False

    def put_threadsafe(self, item: RequestOutput | BaseException) -> None:
        # A closed event loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    """Serve many concurrent requests from one engine loop.

    ``start()`` loads the model in the loop thread (``is_ready`` turns true when done);
    ``generate()`` yields ``RequestOutput`` deltas; leaving the iterator early
    (``break``, cancellation) aborts the request and frees its KV blocks within one
    engine step.
    """

    def __init__(
        self,
        config: EngineConfig,
        engine_factory: Callable[[EngineConfig], Any] | None = None,
        step_observers: list[Callable[[Any, list[RequestOutput], Any], None]] | None = None,
    ) -> None:
        self.config = config
        self._engine_factory = engine_factory
        # Called in the loop thread with (LLMEngine, outputs, StepRecord) after every
        # step, and with (LLMEngine, [abort output], None) after an abort: the metrics
        # exporter and request logging hang here.
        self.step_observers = list(step_observers or [])
        self._engine: Any = None
        self._commands: queue.SimpleQueue[_AddCommand | _AbortCommand | None] = queue.SimpleQueue()
        self._streams: dict[str, _RequestStream] = {}
        self._streams_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopping = False
        self._dead_error: BaseException | None = None
        self._num_waiting = 0
        self._id_counter = itertools.count()
        # A tokenizer for the front end (chat templates, Tokenize RPC); the loop thread
        # keeps its own so the two never share a Rust tokenizer across threads.
        self.tokenizer: Any = None
        self.model_info: dict[str, Any] = {}
        self.stats: Any = None

    # ---- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def wait_ready(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready.is_set():
            if self._dead_error is not None:
                raise EngineDeadError(f"engine failed to start: {self._dead_error}")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("engine did not become ready in time")
            await asyncio.sleep(0.05)

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self._dead_error is None

    @property
    def is_healthy(self) -> bool:
        return self._dead_error is None and not self._stopping

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight end with EngineShutdownError."""
        self._stopping = True
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- requests ----------------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int] | None,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        priority: int = 0,
        messages: list[dict[str, str]] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its output deltas until it finishes.

        Raises ValueError for bad input (before any output), EngineOverloadedError
        when the waiting queue is full, EngineDeadError when the engine has failed,
        EngineShutdownError while shutting down.
        """
        request_id = request_id or f"req-{uuid.uuid4().hex[:16]}"
        stream = self._admit(request_id)
        self._commands.put(_AddCommand(request_id, prompt, messages, params, priority, stream))
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    stream.finished = True
                    return
        finally:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            if not stream.finished:
                self._commands.put(_AbortCommand(request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_AbortCommand(request_id))

    def _admit(self, request_id: str) -> _RequestStream:
        if self._stopping:
            raise EngineShutdownError("engine is shutting down")
        if self._dead_error is not None:
            raise EngineDeadError(f"engine has failed: {self._dead_error}")
        if not self._ready.is_set():
            raise EngineShutdownError("engine is still loading the model")
        limit = self.config.max_waiting_requests
        if self._num_waiting >= limit:
            raise EngineOverloadedError(self._num_waiting, limit)
        stream = _RequestStream(request_id, asyncio.get_running_loop())
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in flight")
            self._streams[request_id] = stream
        self._num_waiting += 1
        return stream

    # ---- loop thread -------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._engine = self._build_engine()
            self.tokenizer = copy.deepcopy(self._engine.tokenizer)
            self.model_info = self._engine.model_info()
            self._refresh_stats()
            self._ready.set()
            self._loop()
        except BaseException as exc:  # the loop must never die silently
            logger.exception("engine loop failed")
            self._fail_all(exc)
        finally:
            if self._stopping:
                self._end_all(EngineShutdownError("engine shut down"))

    def _build_engine(self) -> Any:
        if self._engine_factory is not None:
            return self._engine_factory(self.config)
        from engine.llm_engine import LLMEngine

        return LLMEngine(self.config)

    def _loop(self) -> None:
        engine = self._engine
        while not self._stopping:
            block = not engine.has_unfinished_requests()
            if not self._drain_commands(block):
                return
            if not engine.has_unfinished_requests():
                continue
            outputs = engine.step()
            self.stats = engine.stats
            self._num_waiting = engine.num_waiting_requests + self._commands.qsize()
            for output in outputs:
                self._deliver(output)
            for observe in self.step_observers:
                observe(engine, outputs, engine.last_step)

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands. Returns False when asked to stop."""
        while True:
            try:
                command = (
                    self._commands.get(timeout=_IDLE_WAIT_S)
                    if block
                    else (self._commands.get_nowait())
                )
            except queue.Empty:
                return True
            block = False
            if command is None:
                return False
            if isinstance(command, _AbortCommand):
                output = self._engine.abort_request(command.request_id)
                self._refresh_stats()
                if output is not None:
                    for observe in self.step_observers:
                        observe(self._engine, [output], None)
                continue
            self._add(command)

    def _refresh_stats(self) -> None:
        # An abort frees KV blocks outside step(); publish that now, because an idle
        # engine may not step again for a long time (the stats RPC would show a leak).
        engine = self._engine
        refresh = getattr(engine, "refresh_stats", None)
        if refresh is not None:
            refresh()
        self.stats = engine.stats

    def _add(self, command: _AddCommand) -> None:
        try:
            self._engine.add_request(
                command.request_id,
                command.prompt,
                command.params,
                priority=command.priority,
                messages=command.messages,
            )
        except ValueError as exc:
            self._num_waiting = max(0, self._num_waiting - 1)
            command.stream.put_threadsafe(exc)
        except Exception as exc:  # noqa: BLE001 - one bad prompt must not stop the loop
            logger.warning(
                "request %s rejected: %s: %s", command.request_id, type(exc).__name__, exc
            )
            self._num_waiting = max(0, self._num_waiting - 1)
            command.stream.put_threadsafe(
                ValueError(f"prompt could not be processed: {type(exc).__name__}: {exc}")
            )

    def _deliver(self, output: RequestOutput) -> None:
        with self._streams_lock:
            stream = self._streams.get(output.request_id)
        if stream is not None:
            stream.put_threadsafe(output)

    def _fail_all(self, exc: BaseException) -> None:
        self._dead_error = exc
        self._end_all(EngineDeadError(f"engine failed: {type(exc).__name__}: {exc}"))

    def _end_all(self, error: BaseException) -> None:
        with self._streams_lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.put_threadsafe(error)
