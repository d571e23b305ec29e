"""Errors the engine raises to its callers."""

from __future__ import annotations


class EngineError(RuntimeError):
    """Base class for errors that end a request without being the caller's fault."""


class RequestFailedError(ValueError):
    """A request that the caller's own input ended mid-output: its structured_output
    constraint failed (the parser's limits, the step budget). Nothing else is touched;
    gRPC callers get INVALID_ARGUMENT with this one-line message."""


class ModelOutputError(EngineError):
    """A request the model itself failed mid-output (its logits were not finite):
    it ended alone, nothing sampled from those logits reached the caller; gRPC callers
    get INTERNAL with this one-line message. Not the caller's fault, and not the
    engine's death: other requests go on."""


class EngineOverloadedError(EngineError):
    """The bounded waiting queue is full; the caller should retry later."""

    def __init__(self, num_waiting: int, limit: int, retry_after_s: float = 1.0) -> None:
        super().__init__(
            f"engine overloaded: {num_waiting} requests waiting (limit {limit}); "
            f"retry in about {retry_after_s:.1f}s"
        )
        self.retry_after_s = retry_after_s


class EngineDeadError(EngineError):
    """The engine loop failed; every in-flight request ends with this error."""


class EngineShutdownError(EngineError):
    """The engine is shutting down and accepts no new requests."""


class ModelLoadError(RuntimeError):
    """A model could not be found, fetched or read. The message is one line."""
