"""AsyncEngine: the engine loop in a background thread, requests as async iterators.

The loop thread owns the LLMEngine (model, KV cache, scheduler, tokenizer for
detokenization). The asyncio side talks to it only through a command queue (add /
abort) and per-request output queues filled with ``call_soon_threadsafe``. Text and
chat prompts are encoded on the PromptEncoder's worker threads, neither here nor there.

Every request gets an internal key, unique for the engine's lifetime; outputs, aborts
and the engine's own bookkeeping use that key. The caller's ``request_id`` is only a
label (logs, responses, ``abort``): two requests with the same label never see each
other's outputs. A label belongs to an ``owner`` (the server's caller, by API key):
``abort`` reaches only the requests of the owner that names the label.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineShutdownError,
    ModelOutputError,
    RequestFailedError,
)
from engine.io.outputs import RequestOutput
from engine.io.prompt_encoder import PromptEncoder
from engine.io.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05
T = TypeVar("T")


@dataclass(slots=True)
class _AddCommand:
    stream: _RequestStream
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    params: SamplingParams
    priority: int
    grammar: Any = None  # the structured_output constraint, compiled off the engine thread


@dataclass(slots=True)
class _AbortCommand:
    key: str


@dataclass(slots=True)
class _CallCommand:
    """Run ``fn(engine)`` on the loop thread; its result or exception settles ``future``."""

    fn: Callable[[Any], Any]
    future: asyncio.Future


class _RequestStream:
    """Per-request output queue; items are RequestOutput or an exception to raise."""

    __slots__ = ("key", "label", "owner", "queue", "loop", "finished", "aborted", "abort_event")

    def __init__(
        self,
        key: str,
        label: str,
        owner: str | None,
        loop: asyncio.AbstractEventLoop,
        abort_event: asyncio.Event,
    ) -> None:
        self.key = key  # internal, unique: what the LLMEngine knows the request by
        self.label = label  # the caller's request_id
        self.owner = owner  # who may abort it by label (None: callers without an id)
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.loop = loop
        self.finished = False
        self.aborted = False  # set by abort(label); read by the loop thread
        # Set after ``aborted``, on this stream's loop: wakes a Reservation waiting for
        # a prompt. The streams admitted together share it.
        self.abort_event = abort_event

    def mark_aborted(self) -> None:
        self.aborted = True
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting
            self.loop.call_soon_threadsafe(self.abort_event.set)

    def put_threadsafe(self, item: RequestOutput | BaseException) -> None:
        # A closed event loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Reservation:
    """Requests admitted together under one label before their prompts are known
    (``AsyncEngine.reserve``): ``abort(label, owner)`` reaches every one of them from the
    moment they exist, before, while and after each is started with ``generate``."""

    def __init__(self, engine: AsyncEngine, streams: list[_RequestStream]) -> None:
        self._engine = engine
        self._streams = streams

    @property
    def aborted(self) -> bool:
        return self._streams[0].aborted  # abort(label) marks them all at once

    def generate(
        self, index: int, prompt: str | list[int] | None, params: SamplingParams, **kwargs: Any
    ) -> AsyncIterator[RequestOutput]:
        """Request ``index`` (each at most once), as ``AsyncEngine.generate`` runs it.
        One aborted before it starts is added and aborted on the engine thread in one
        go: it ends with an "abort" output and never holds a KV block."""
        return self._engine.generate(prompt, params, reserved=self._streams[index], **kwargs)

    async def unless_aborted(self, awaitable: Awaitable[T]) -> T | None:
        """``awaitable``'s result, or None as soon as ``abort(label)`` reaches these
        requests; ``awaitable`` is then cancelled (a prompt queued for the encoder is
        dropped, not encoded)."""
        work = asyncio.ensure_future(awaitable)
        aborted = asyncio.ensure_future(self._streams[0].abort_event.wait())
        try:
            await asyncio.wait((work, aborted), return_when=asyncio.FIRST_COMPLETED)
        finally:
            aborted.cancel()
            work.cancel()  # nothing when it is done; also when we are cancelled
        if not self.aborted:
            return work.result()
        if work.done() and not work.cancelled():
            work.exception()  # retrieved: an abort wins over a failure that came with it
        return None

    def close(self) -> None:
        """Give back the places of requests never started (``generate`` gives back its
        own when it ends). Call it once every started request has ended."""
        self._engine._release(self._streams)


def freeze_startup_heap() -> int:
    """Collect garbage, then move every object the process holds into the collector's
    permanent generation (``gc.freeze``), as vLLM does once its engine is up; returns how
    many objects that is. A full collection scans every tracked object while the
    interpreter holds its lock: with the default model loaded, about 350,000 objects and
    150-180 ms in which no stream advances (docs/operations.md). Frozen, the modules, the
    model and the tokenizer are skipped; serving's own objects are still collected."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class AsyncEngine:
    """Serve many concurrent requests from one engine loop.

    ``start()`` loads the model in the loop thread (``is_ready`` turns true when done);
    ``generate()`` yields ``RequestOutput`` deltas; leaving the iterator early
    (``break``, cancellation) aborts the request and frees its KV blocks within one
    engine step.

    Admission: at most ``max_num_seqs + max_waiting_requests`` requests are in flight
    (admitted and not yet finished, failed or cancelled); more are refused with
    EngineOverloadedError. A request leaves the count the moment its iterator ends.

    ``freeze_heap``: once the model is loaded and before ``is_ready``, collect and
    freeze the process's heap (``freeze_startup_heap``); the server sets it, a library
    user who makes and drops engines should not (frozen objects are never collected).
    """

    def __init__(
        self,
        config: EngineConfig,
        engine_factory: Callable[[EngineConfig], Any] | None = None,
        step_observers: list[Callable[[Any, list[RequestOutput], Any], None]] | None = None,
        *,
        freeze_heap: bool = False,
    ) -> None:
        self.config = config
        self._engine_factory = engine_factory
        self._freeze_heap = freeze_heap
        # Called in the loop thread with (LLMEngine, outputs, StepRecord) after every
        # step, and with (LLMEngine, [abort output], None) after an abort: the metrics
        # exporter and request logging hang here.
        self.step_observers = list(step_observers or [])
        # Called in the loop thread with the exception once, when the engine fails.
        self.failure_observers: list[Callable[[BaseException], None]] = []
        # Called in the loop thread with the target pool's prefix-cache events
        # (block_manager.kv_events) after every step or command that produced some.
        # Set it before start(): events are recorded from the first step only then.
        self.kv_event_listener: Callable[[list], None] | None = None
        self._engine: Any = None
        self._commands: queue.SimpleQueue[_AddCommand | _AbortCommand | _CallCommand | None] = (
            queue.SimpleQueue()
        )
        # In-flight requests by key. The lock also makes admission atomic with the
        # flags below: a request is either registered before _end_all takes its list,
        # or sees the engine dead / stopping.
        self._streams: dict[str, _RequestStream] = {}
        self._streams_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopping = False
        self._dead_error: BaseException | None = None
        self._ended = False  # _end_all ran: nobody will ever serve a new stream
        self._keys = itertools.count()
        self._encoder: PromptEncoder | None = None
        # Structured-output constraints compile here: off the event loop and the engine
        # thread. Two threads: one slow schema delays the next, never the server.
        self._compile_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        self.model_info: dict[str, Any] = {}
        # An EngineStats snapshot, replaced (never mutated) by the loop thread after
        # every step and abort; None until the model is loaded.
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

    @property
    def max_in_flight(self) -> int:
        return self.config.max_num_seqs + self.config.max_waiting_requests

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight end with EngineShutdownError."""
        with self._streams_lock:
            self._stopping = True
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        if self._encoder is not None:
            self._encoder.shutdown()
        self._compile_pool.shutdown(wait=False, cancel_futures=True)

    # ---- requests ----------------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int] | None,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        priority: int = 0,
        messages: list[dict[str, str]] | None = None,
        owner: str | None = None,
        reserved: _RequestStream | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its output deltas until it finishes.

        ``request_id`` is the caller's label for the request (generated when None): it
        comes back as each output's ``client_request_id`` and is what ``abort`` takes,
        with the same ``owner`` (the caller's identity; None for one without).
        Labels need not be unique: requests sharing one run independently, each output
        reaches only its own iterator (``RequestOutput.request_id`` is the internal key).

        Text and chat prompts are encoded on a worker thread. Raises ValueError for bad
        input (before any output), EngineOverloadedError when the engine already holds
        ``max_num_seqs + max_waiting_requests`` requests, EngineDeadError when the
        engine has failed, EngineShutdownError while loading or shutting down.
        ``reserved`` (from ``Reservation.generate``): admitted already, under its label.
        """
        if messages is not None and prompt:
            raise ValueError("give either prompt or messages, not both")
        stream = reserved or self._admit(request_id, 1, owner)[0]
        submitted = False
        try:
            if isinstance(prompt, str) or messages is not None:
                prompt = await self._encode(prompt, messages, params.truncate_prompt_tokens)
                messages = None
            grammar = await self._compile(params)
            self._commands.put(_AddCommand(stream, prompt, messages, params, priority, grammar))
            submitted = True
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason == "error":
                    stream.finished = True
                    if item.error is not None:  # the model failed it (non-finite logits)
                        raise ModelOutputError(item.error)
                    # its constraint failed: the caller's input
                    raise RequestFailedError(item.finish_detail or "the request failed")
                yield item
                if item.finished:
                    stream.finished = True
                    return
        finally:
            self._release([stream])
            if submitted and not stream.finished:
                self._commands.put(_AbortCommand(stream.key))

    async def _compile(self, params: SamplingParams):
        """The request's constraint compiled on a worker thread (never the loop or the
        engine thread), within ``envs.grammar_compile_timeout_s()``; None without one."""
        constraint = params.structured_output
        if constraint is None:
            return None
        from engine import envs
        from engine.sample.grammar import ConstraintError

        limit = envs.grammar_compile_timeout_s()
        work = asyncio.get_running_loop().run_in_executor(
            self._compile_pool, self._engine.grammars.grammar, constraint
        )
        try:
            return await asyncio.wait_for(work, timeout=limit)
        except TimeoutError:
            raise ConstraintError(
                f"structured_output.{constraint.kind} took longer than {limit:g} s to compile "
                "(SPECSERVE_GRAMMAR_COMPILE_TIMEOUT_S); simplify it"
            ) from None

    def reserve(
        self, request_id: str | None, num_requests: int = 1, owner: str | None = None
    ) -> Reservation:
        """Admit ``num_requests`` requests under one label now, all or none, before
        their prompts are known: an ``abort(request_id, owner)`` from this moment on ends
        every one of them, even one whose prompt is still being encoded or that has not
        started yet. Start each with ``Reservation.generate``; ``Reservation.close``
        gives back the places of those never started. Raises as ``generate`` does."""
        return Reservation(self, self._admit(request_id, num_requests, owner))

    async def tokenize(
        self,
        prompt: str | None = None,
        messages: list[dict[str, str]] | None = None,
        max_tokens: int | None = None,
    ) -> list[int]:
        """``prompt``, or ``messages`` through the chat template, as token ids; encoded
        on a worker thread exactly as ``generate`` encodes them. ValueError when there
        are more than ``max_tokens`` (a long text is refused from a prefix)."""
        if self._encoder is None:
            raise EngineShutdownError("engine is still loading the model")
        return await self._encoder.encode(prompt, messages, max_tokens)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(llm_engine)`` run on the loop thread between steps (the only thread that
        may touch the engine); returns its result or raises its exception."""
        future = asyncio.get_running_loop().create_future()
        # Queued under the lock: _end_all either sees this command or we see it ran.
        with self._streams_lock:
            if self._dead_error is not None:
                raise EngineDeadError(f"engine has failed: {self._dead_error}")
            if self._stopping or self._ended or not self._ready.is_set():
                raise EngineShutdownError("engine is not running")
            self._commands.put(_CallCommand(fn, future))
        return await future

    async def reset_prefix_cache(self) -> tuple[int, int]:
        """Drop every cached block no request holds. Returns (blocks dropped, blocks
        still cached because running requests hold them)."""

        def reset(engine: Any) -> tuple[int, int]:
            manager = engine.kv_manager
            return manager.reset_prefix_cache(), len(manager.pool.cached_blocks)

        return await self.call(reset)

    async def abort(self, request_id: str, owner: str | None = None) -> int:
        """Abort every in-flight request of ``owner`` labelled ``request_id``; returns how
        many. Each ends with a last output whose finish_reason is "abort". Another
        owner's requests under the same label are not touched."""
        with self._streams_lock:
            streams = [
                s for s in self._streams.values() if s.label == request_id and s.owner == owner
            ]
            for stream in streams:
                stream.mark_aborted()
                self._commands.put(_AbortCommand(stream.key))
        return len(streams)

    def _admit(
        self, request_id: str | None, num_requests: int, owner: str | None
    ) -> list[_RequestStream]:
        """Register ``num_requests`` streams under one label of ``owner``, all or none."""
        label = request_id or f"req-{uuid.uuid4().hex[:16]}"
        loop = asyncio.get_running_loop()
        abort_event = asyncio.Event()
        with self._streams_lock:
            if self._dead_error is not None:
                raise EngineDeadError(f"engine has failed: {self._dead_error}")
            if self._stopping or self._ended:
                raise EngineShutdownError("engine is shutting down")
            if not self._ready.is_set():
                raise EngineShutdownError("engine is still loading the model")
            num_in_flight = len(self._streams)
            if num_in_flight + num_requests > self.max_in_flight:
                # Running slots are full, so at least this many requests are waiting.
                raise EngineOverloadedError(
                    max(num_in_flight - self.config.max_num_seqs, 0),
                    self.config.max_waiting_requests,
                )
            streams = [
                _RequestStream(f"a{next(self._keys)}", label, owner, loop, abort_event)
                for _ in range(num_requests)
            ]
            for stream in streams:
                self._streams[stream.key] = stream
        return streams

    def _release(self, streams: list[_RequestStream]) -> None:
        with self._streams_lock:
            for stream in streams:
                self._streams.pop(stream.key, None)

    async def _encode(
        self,
        prompt: str | None,
        messages: list[dict[str, str]] | None,
        truncate_prompt_tokens: int | None,
    ) -> list[int]:
        """Token ids for generate(); a prompt too long for the context is refused here,
        often from a prefix, rather than on the engine thread. A prompt the request asks
        to truncate is encoded whole (the server's character cap bounds that work); the
        engine keeps its last tokens and checks the length after."""
        if self._encoder is None:
            raise EngineShutdownError("engine is still loading the model")
        max_model_len = int(self.model_info.get("max_model_len") or 0)
        max_tokens = max_model_len - 1 if max_model_len and not truncate_prompt_tokens else None
        return await self._encoder.encode(prompt, messages, max_tokens)

    # ---- loop thread -------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._engine = self._build_engine()
            recorder = getattr(self._engine, "kv_events", None)
            if recorder is not None and self.kv_event_listener is not None:
                recorder.enabled = True
            self._encoder = PromptEncoder(self._engine.tokenizer)
            self.model_info = self._engine.model_info()
            self.model_info["max_token_chars"] = self._encoder.max_token_chars
            self._refresh_stats()
            grammars = getattr(self._engine, "grammars", None)
            if self._freeze_heap:
                frozen = freeze_startup_heap()
                logger.info("start-up heap frozen: %d objects the garbage collector skips", frozen)
            if grammars is not None:  # the first constrained request need not wait for it
                self._compile_pool.submit(grammars.prepare)
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
        from engine.core.llm_engine import LLMEngine

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
            self._publish_stats()
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
                self._abort(command.key)
            elif isinstance(command, _CallCommand):
                self._call(command)
            else:
                self._add(command)

    def _abort(self, key: str) -> None:
        output = self._engine.abort_request(key)
        self._refresh_stats()
        if output is None:
            return
        self._deliver(output)  # reaches only a stream still listening: abort(label)
        for observe in self.step_observers:
            observe(self._engine, [output], None)

    def _call(self, command: _CallCommand) -> None:
        future = command.future
        try:
            result = command.fn(self._engine)
        except Exception as exc:  # noqa: BLE001 - the caller gets it, the loop goes on
            _settle(future, exc, None)
        else:
            _settle(future, None, result)
        self._refresh_stats()

    def _refresh_stats(self) -> None:
        # An abort frees KV blocks outside step(); publish that now, because an idle
        # engine may not step again for a long time (the stats RPC would show a leak).
        refresh = getattr(self._engine, "refresh_stats", None)
        if refresh is not None:
            refresh()
        self._publish_stats()

    def _publish_stats(self) -> None:
        # Readers on other threads get a copy: the engine keeps mutating its own.
        self.stats = self._engine.stats.snapshot()
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        recorder = getattr(self._engine, "kv_events", None)
        if recorder is None or not recorder.enabled or self.kv_event_listener is None:
            return
        events = recorder.take()
        if events:
            self.kv_event_listener(events)

    def _add(self, command: _AddCommand) -> None:
        stream = command.stream
        try:
            self._engine.add_request(
                stream.key,
                command.prompt,
                command.params,
                priority=command.priority,
                messages=command.messages,
                client_request_id=stream.label,
                grammar=command.grammar,
                cache_scope=stream.owner,
            )
        except ValueError as exc:
            stream.put_threadsafe(exc)
            return
        except Exception as exc:  # noqa: BLE001 - one bad prompt must not stop the loop
            logger.warning("request %s rejected: %s: %s", stream.label, type(exc).__name__, exc)
            stream.put_threadsafe(
                ValueError(f"prompt could not be processed: {type(exc).__name__}: {exc}")
            )
            return
        if stream.aborted:  # abort(label) came before the request reached the engine
            self._abort(stream.key)

    def _deliver(self, output: RequestOutput) -> None:
        with self._streams_lock:
            stream = self._streams.get(output.request_id)
        if stream is not None:
            stream.put_threadsafe(output)

    def _fail_all(self, exc: BaseException) -> None:
        with self._streams_lock:
            self._dead_error = exc
        # Observers first: a caller told of the failure then sees it in the metrics too.
        for observe in self.failure_observers:
            try:
                observe(exc)
            except Exception:  # an observer bug must not hide the engine's failure
                logger.exception("engine failure observer failed")
        self._end_all(EngineDeadError(f"engine failed: {type(exc).__name__}: {exc}"))

    def _end_all(self, error: BaseException) -> None:
        with self._streams_lock:
            self._ended = True
            streams = list(self._streams.values())
        for stream in streams:
            stream.put_threadsafe(error)
        self._fail_calls(error)

    def _fail_calls(self, error: BaseException) -> None:
        """Calls still queued when the loop ends get ``error``, not a future never set."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _CallCommand):
                _settle(command.future, error, None)


def _settle(future: asyncio.Future, error: BaseException | None, result: Any) -> None:
    """Resolve ``future`` from another thread (its loop may already be closed)."""

    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    with contextlib.suppress(RuntimeError):
        future.get_loop().call_soon_threadsafe(settle)
