"""The JSON protocol between `bench offline` and its external baseline workers.

Standard library only: the workers import this file from their own directory, run by the
python of another virtualenv that has no specserve. The parent writes one request object
to the worker's stdin; the worker answers with one line on stdout, `RESULT_TAG` or
`ERROR_TAG` followed by a JSON object, so a library that prints to stdout cannot corrupt
the answer. Times are seconds on the worker's own clock, relative to each request's start.

request: {"protocol", "model", "prompts": [[token ids]], "output_len", "concurrency",
          "dtype", "num_threads"}
result:  {"protocol", "engine", "version", "input": "token_ids" | "text", "duration_s",
          "requests": [{"ttft_s": float | null, "latency_s", "num_tokens"}]}
error:   {"protocol", "kind": "missing_package" | "bad_request" | "failed", "message"}
"""

from __future__ import annotations

import json
import sys

PROTOCOL = 1
RESULT_TAG = "SPECSERVE_RESULT "
ERROR_TAG = "SPECSERVE_ERROR "
EXIT_MISSING_PACKAGE = 3
EXIT_FAILED = 4
_REQUEST_KEYS = ("model", "prompts", "output_len", "concurrency", "dtype", "num_threads")


class WorkerError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def read_request(stream=None) -> dict:
    """The parent's request, checked: a worker never runs on a half-formed one."""
    try:
        request = json.loads((stream or sys.stdin).read())
    except json.JSONDecodeError as exc:
        raise WorkerError("bad_request", f"request is not JSON: {exc}") from None
    if not isinstance(request, dict) or request.get("protocol") != PROTOCOL:
        raise WorkerError("bad_request", f"request must be a protocol {PROTOCOL} object")
    missing = [k for k in _REQUEST_KEYS if k not in request]
    if missing:
        raise WorkerError("bad_request", f"request lacks {', '.join(missing)}")
    prompts = request["prompts"]
    if not prompts or not all(isinstance(p, list) and p for p in prompts):
        raise WorkerError("bad_request", "prompts must be non-empty lists of token ids")
    for key in ("output_len", "concurrency", "num_threads"):
        if not isinstance(request[key], int) or request[key] < 1:
            raise WorkerError("bad_request", f"{key} must be an int >= 1")
    return request


def check_counts(requests: list[dict], output_len: int, engine: str) -> None:
    """Every system must do the same work: exactly output_len tokens per request."""
    for i, r in enumerate(requests):
        if r["num_tokens"] != output_len:
            raise WorkerError(
                "failed",
                f"{engine} generated {r['num_tokens']} tokens for request {i}, "
                f"expected {output_len} (EOS must be ignored)",
            )


def emit_result(engine: str, version: str, text_input: bool, duration_s: float, requests):
    print(
        RESULT_TAG
        + json.dumps(
            {
                "protocol": PROTOCOL,
                "engine": engine,
                "version": version,
                "input": "text" if text_input else "token_ids",
                "duration_s": duration_s,
                "requests": requests,
            }
        ),
        flush=True,
    )


def emit_error(kind: str, message: str) -> int:
    """Report a failure on stdout; the exit status to leave with."""
    error = {"protocol": PROTOCOL, "kind": kind, "message": message}
    print(ERROR_TAG + json.dumps(error), flush=True)
    return EXIT_MISSING_PACKAGE if kind == "missing_package" else EXIT_FAILED


def parse_answer(stdout: str) -> dict:
    """The last tagged line of a worker's stdout as {"result": ...} or {"error": ...}."""
    for line in reversed(stdout.splitlines()):
        for tag, key in ((RESULT_TAG, "result"), (ERROR_TAG, "error")):
            if line.startswith(tag):
                try:
                    return {key: json.loads(line[len(tag) :])}
                except json.JSONDecodeError:
                    return {}
    return {}


def serve(module: str, run, check=None) -> int:
    """A worker's main: read the request, ``check(request)`` it (raise WorkerError to
    refuse), import ``module`` (missing: the "missing_package" answer the parent turns
    into the install command), then ``run(imported module, request)``; any failure is
    one error line for the parent."""
    try:
        request = read_request()
        if check is not None:
            check(request)
    except WorkerError as exc:
        return emit_error(exc.kind, str(exc))
    try:
        imported = __import__(module)
    except ImportError as exc:
        return emit_error("missing_package", f"{module} is not importable: {exc}")
    try:
        return run(imported, request)
    except WorkerError as exc:
        return emit_error(exc.kind, str(exc))
    except Exception as exc:  # any engine failure: one line for the parent
        return emit_error("failed", f"{type(exc).__name__}: {exc}")
