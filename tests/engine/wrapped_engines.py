"""LLMEngine wrappers for AsyncEngine tests: hold steps at a gate, fail on demand, and
record which thread tokenizes."""

from __future__ import annotations

import copy
import threading
from typing import Any

from engine.core.llm_engine import LLMEngine


class GatedEngine:
    """The real engine, whose step() waits until ``gate`` is set (at most 60 s): the
    engine is busy for as long as a test needs, with no timing involved."""

    def __init__(self, inner: LLMEngine, gate: threading.Event) -> None:
        self._inner = inner
        self._gate = gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def step(self):
        self._gate.wait(60)
        return self._inner.step()


class FailingEngine:
    """The real engine, whose step() raises once ``fail`` is set."""

    def __init__(self, inner: LLMEngine, fail: threading.Event) -> None:
        self._inner = inner
        self._fail = fail

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def step(self):
        if self._fail.is_set():
            raise RuntimeError("injected device fault")
        return self._inner.step()


class RecordingTokenizer:
    """Forwards to a real tokenizer; records the thread of every encode and chat
    template call, shared by all its deep copies."""

    RECORDED = ("encode", "apply_chat_template", "__call__")

    def __init__(self, inner: Any, calls: list[tuple[str, str]] | None = None) -> None:
        self._inner = inner
        self.calls: list[tuple[str, str]] = [] if calls is None else calls

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in self.RECORDED:
            return attr

        def recorded(*args, **kwargs):
            self.calls.append((name, threading.current_thread().name))
            return attr(*args, **kwargs)

        return recorded

    def __call__(self, *args, **kwargs):
        self.calls.append(("__call__", threading.current_thread().name))
        return self._inner(*args, **kwargs)

    def __deepcopy__(self, memo) -> RecordingTokenizer:
        return RecordingTokenizer(copy.deepcopy(self._inner, memo), self.calls)


def recording_engine(config) -> LLMEngine:
    """A real engine whose every tokenizer reference records its callers' threads."""
    engine = LLMEngine(config)
    tokenizer = RecordingTokenizer(engine.tokenizer)
    engine.tokenizer = tokenizer
    engine.input_processor.tokenizer = tokenizer
    return engine
