"""Request-completion logs and the process's log format (text or JSON lines).

    setup_logging(args.log_format, args.log_level)
    async_engine.step_observers.append(RequestLogger(args.log_format == "json",
                                                     args.log_prompts).observe_step)

One line per finished request: id, token counts, ttft, acceptance rate, finish reason.
Prompt text never appears unless ``log_prompts`` is set: prompts may hold private data.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

REQUEST_LOGGER_NAME = "specserve.requests"
LOG_FORMATS = ("text", "json")
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class RequestLogger:
    """AsyncEngine step observer that logs each finished request once."""

    def __init__(
        self, json: bool = False, log_prompts: bool = False, rpc_log_limit: RateLimit | None = None
    ) -> None:
        self.json = json
        self.log_prompts = log_prompts
        self.logger = logging.getLogger(REQUEST_LOGGER_NAME)
        # Completion tokens so far per running request (outputs are deltas).
        self._num_tokens: dict[str, int] = {}
        self._num_failures = 0
        self._rpc_log_limit = rpc_log_limit or RateLimit()

    def observe_step(self, llm_engine: Any, outputs: list[Any], step: Any | None) -> None:
        """AsyncEngine step observer. Never raises: logging must not stop the engine."""
        try:
            self._observe(llm_engine, outputs)
        except Exception:
            self._num_failures += 1
            if self._num_failures == 1:
                self.logger.exception("request logger failed (later failures are not logged)")

    def _observe(self, llm_engine: Any, outputs: list[Any]) -> None:
        for output in outputs:
            total = self._num_tokens.get(output.request_id, 0) + len(output.token_ids)
            if not output.finished:
                self._num_tokens[output.request_id] = total
                continue
            self._num_tokens.pop(output.request_id, None)
            self.log_finished(output, total, llm_engine)

    def log_finished(self, output: Any, num_completion_tokens: int, llm_engine: Any = None) -> None:
        fields = request_fields(output, num_completion_tokens)
        if self.log_prompts:
            fields["prompt"] = _decode(llm_engine, output.prompt_token_ids)
        failed = output.finish_reason == "error" or getattr(output, "error", None)
        level = logging.WARNING if failed else logging.INFO
        if self.json:
            self.logger.log(level, "request finished", extra={"fields": fields})
        else:
            text = " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
            self.logger.log(level, "request finished %s", text, extra={"fields": fields})

    def on_rpc_error(
        self, code_name: str, details: str = "", request_id: str | None = None
    ) -> None:
        """One line for an RPC that ended with a non-OK status: INFO when the client
        cancelled, else WARNING; rate-limited per code (a flood of bad bodies or wrong
        keys must not flood the log), the next logged line counting what was dropped."""
        num_suppressed = self._rpc_log_limit.admit(code_name)
        if num_suppressed is None:
            return
        fields: dict[str, Any] = {"code": code_name, "details": " ".join(details.split())[:500]}
        if request_id:
            fields["request_id"] = request_id
        if num_suppressed:
            fields["suppressed"] = num_suppressed
        level = logging.INFO if code_name == "CANCELLED" else logging.WARNING
        text = " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        self.logger.log(level, "rpc failed %s", text, extra={"fields": fields})


@dataclass(slots=True)
class _Window:
    start: float
    num_logged: int = 0
    num_dropped: int = 0  # since the last line logged


class RateLimit:
    """At most ``max_lines`` per key in each ``window_s`` window.

    ``admit(key)`` returns None to drop a line, else how many lines of that key were
    dropped since the last one admitted. Thread-safe: RPC hooks run on the event loop
    and, for sync callers, on other threads.
    """

    def __init__(
        self,
        max_lines: int = 10,
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_lines < 1:
            raise ValueError(f"max_lines must be >= 1, got {max_lines}")
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.max_lines = max_lines
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}

    def admit(self, key: str) -> int | None:
        now = self._clock()
        with self._lock:
            window = self._windows.setdefault(key, _Window(now))
            if now - window.start >= self.window_s:
                window.start, window.num_logged = now, 0
            if window.num_logged >= self.max_lines:
                window.num_dropped += 1
                return None
            num_dropped, window.num_dropped = window.num_dropped, 0
            window.num_logged += 1
            return num_dropped


def request_fields(output: Any, num_completion_tokens: int) -> dict[str, Any]:
    """What the completion log line says about a finished request (no prompt text)."""
    m = output.metrics
    e2e = None if m.finished_time is None else m.finished_time - m.arrival_time
    fields: dict[str, Any] = {
        "request_id": getattr(output, "label", output.request_id),  # the caller's id
        "finish_reason": output.finish_reason,
        "prompt_tokens": m.num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "cached_prompt_tokens": m.num_cached_prompt_tokens,
        "draft_tokens": m.num_draft_tokens,
        "accepted_tokens": m.num_accepted_tokens,
        "acceptance_rate": _ratio(m.num_accepted_tokens, m.num_draft_tokens),
        "ttft_s": _round(m.time_to_first_token),
        "queue_s": _round(m.queue_time),
        "e2e_s": _round(e2e),
        "preemptions": m.num_preemptions,
    }
    error = getattr(output, "error", None)
    if error:
        fields["error"] = " ".join(str(error).split())
    return fields


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, plus the record's ``fields``."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": " ".join(record.getMessage().split()),
        }
        entry.update(getattr(record, "fields", None) or {})
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            entry["exc"] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """Human-readable, one line per record, exceptions folded into the line."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = " ".join(super().format(_without_exc(record)).split())
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            line += f" | {type(exc).__name__}: {' '.join(str(exc).split())}"
        return line


def setup_logging(log_format: str = "text", level: str | int = "INFO") -> None:
    """Root logger to stderr in ``log_format`` ("text" or "json")."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def _without_exc(record: logging.LogRecord) -> logging.LogRecord:
    return logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})


def _decode(llm_engine: Any, token_ids: list[int]) -> str | None:
    tokenizer = getattr(llm_engine, "tokenizer", None)
    return None if tokenizer is None else tokenizer.decode(token_ids)


def _ratio(num: int, den: int) -> float | None:
    return round(num / den, 4) if den else None


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)


def _text_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str) and (not value or any(c.isspace() or c in '"=' for c in value)):
        return json.dumps(value)
    return str(value)
