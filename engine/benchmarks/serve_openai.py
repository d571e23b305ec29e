"""`specserve bench serve --backend openai --base-url URL`: the same load and metrics
through an OpenAI-compatible HTTP server, such as the Shepherd Model Gateway (smg) in
front of specserve workers.

Each request is one SSE stream with `stream_options.include_usage`:

    text prompts, chat template on    POST /v1/chat/completions  {"messages": [user turn]}
    text prompts, --no-chat-template  POST /v1/completions       {"prompt": text}
    synthetic token prompts           POST /v1/completions       {"prompt": decoded text}

(`--endpoint chat|completions` overrides the choice). The model is --model-name, or the
one model /v1/models lists. The synthetic and ShareGPT workloads need the model's
tokenizer on the client (--tokenizer; default: the served model's name, when that is a
local directory or a hub id), as the server's Tokenize RPC is not part of the OpenAI API
(setup: engine/benchmarks/serve_openai_setup.py).

A stream message "carries tokens" when it carries generated text. The output token
count is the server's `usage.completion_tokens`; when a server reports it only at the
end, it is spread evenly over the text-carrying messages (for the throughput timeline;
TTFT, ITL and TPOT do not depend on the split). Draft and accepted tokens come from
usage.completion_tokens_details (rejected + accepted prediction tokens), which the
gateway fills from the workers' speculation counts. Errors are named by what went wrong:
HTTP_<status>, STREAM_ERROR (an error event inside the stream), DISCONNECTED (the
stream ended before `data: [DONE]`), CONNECT_ERROR, TIMEOUT (--request-timeout).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.benchmarks.serve_http import (
    ConnectError,
    Disconnected,
    HttpClient,
    HttpStatusError,
)
from engine.benchmarks.serve_stats import RequestRecord
from engine.benchmarks.serve_workload import BenchRequest

ENDPOINTS = ("auto", "chat", "completions")
_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


class StreamError(Exception):
    """An error event (or unreadable data) inside a 200 stream."""


class StreamChunk(NamedTuple):
    """What one SSE data message of a chat or text completion stream says."""

    has_choice: bool
    text: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    # Speculation, where the server reports it: smg maps the vLLM engine protocol's
    # spec_accepted_tokens / spec_draft_tokens to usage.completion_tokens_details.
    accepted_tokens: int | None = None
    draft_tokens: int | None = None


def parse_chunk(data: str) -> StreamChunk:
    """One `data:` payload (not `[DONE]`) of /v1/chat/completions or /v1/completions."""
    try:
        obj = json.loads(data)
    except ValueError:
        raise StreamError(f"not JSON: {data[:120]!r}") from None
    if not isinstance(obj, dict) or "error" in obj:
        raise StreamError(str(obj)[:200])
    choices = obj.get("choices") or []
    choice = choices[0] if choices else {}
    delta = choice.get("delta") or {}
    text = (
        (delta.get("reasoning_content") or "")
        + (delta.get("content") or "")
        + (choice.get("text") or "")
    )
    usage = obj.get("usage") or {}
    details = usage.get("completion_tokens_details") or {}
    accepted = details.get("accepted_prediction_tokens")
    rejected = details.get("rejected_prediction_tokens")
    return StreamChunk(
        bool(choices),
        text,
        choice.get("finish_reason"),
        usage.get("prompt_tokens"),
        usage.get("completion_tokens"),
        accepted,
        None if accepted is None or rejected is None else accepted + rejected,
    )


@dataclass(frozen=True)
class OpenAIOptions:
    """How every BenchRequest becomes an OpenAI streaming request."""

    model: str
    endpoint: str = "auto"
    temperature: float = 0.0
    ignore_eos: bool = True
    chat_template: bool = True
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")

    def endpoint_for(self, req: BenchRequest) -> str:
        if self.endpoint != "auto":
            return self.endpoint
        # Token prompts were cut from a corpus: raw text, no chat turn around it.
        return "chat" if req.token_ids is None and self.chat_template else "completions"

    def wire(self, req: BenchRequest, text: str) -> tuple[str, dict]:
        """(path, JSON body) of the request for `req` whose prompt is `text`."""
        body: dict = {
            "model": self.model,
            "max_tokens": req.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:  # not OpenAI's API; vLLM, SGLang and smg accept it
            body["ignore_eos"] = True
        if req.json_schema is not None:
            schema = {"name": "answer", "schema": json.loads(req.json_schema)}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        endpoint = self.endpoint_for(req)
        if endpoint == "chat":
            turns = [{"role": "system", "content": req.system}] if req.system else []
            body["messages"] = [*turns, {"role": "user", "content": text}]
        else:
            body["prompt"] = f"{req.system}\n\n{text}" if req.system else text
        return _PATHS[endpoint], body


@dataclass(slots=True)
class _Progress:
    """A stream's token accounting while it runs."""

    num_reported: int | None = None  # the latest usage.completion_tokens
    estimated: bool = False  # some text message had no running usage count
    text: list[str] = field(default_factory=list)
    done: bool = False


class OpenAITransport:
    """One SSE stream per request over `client`'s pooled connections."""

    def __init__(self, client: HttpClient, options: OpenAIOptions, tokenizer=None) -> None:
        self._client = client
        self._options = options
        self._tokenizer = tokenizer

    def prepare(self, req: BenchRequest) -> tuple[str, dict]:
        if req.token_ids is None:
            return self._options.wire(req, req.text or "")
        if self._tokenizer is None:
            raise ValueError("token prompts over the OpenAI API need a --tokenizer to decode")
        return self._options.wire(req, self._tokenizer.decode(list(req.token_ids)))

    async def fill(
        self, wire: tuple[str, dict], record: RequestRecord, now: Callable[[], float]
    ) -> None:
        progress = _Progress()
        try:
            stream = self._stream(wire, record, progress, now)
            await asyncio.wait_for(stream, self._options.timeout_s)
        except HttpStatusError as exc:
            record.error = f"HTTP_{exc.status}"
        except StreamError:
            record.error = "STREAM_ERROR"
        except (Disconnected, ConnectionError):
            record.error = "DISCONNECTED"
        except ConnectError:
            record.error = "CONNECT_ERROR"
        except asyncio.TimeoutError:
            record.error = "TIMEOUT"
        except OSError:
            record.error = "DISCONNECTED"
        if record.error is None:
            self._settle(record, progress)

    async def _stream(self, wire, record: RequestRecord, progress: _Progress, now) -> None:
        path, body = wire
        async with self._client.request("POST", path, body) as response:
            if response.status != 200:
                text = (await response.read()).decode("utf-8", "replace")
                raise HttpStatusError(response.status, text)
            # Read on past [DONE] to the body's end, so the connection can be reused.
            async for data in response.sse_data():
                if data.strip() == "[DONE]":
                    record.end, progress.done = now(), True
                elif not progress.done:
                    _observe(record, progress, parse_chunk(data), now())
        if not progress.done:
            raise Disconnected("the stream ended before [DONE]")

    def _settle(self, record: RequestRecord, progress: _Progress) -> None:
        """Make the per-message token counts add up to the stream's output tokens."""
        total = progress.num_reported
        if total is None and self._tokenizer is not None and self._tokenizer.loaded:
            total = len(self._tokenizer.encode("".join(progress.text)))
        if total is None or sum(record.chunk_tokens) == total:
            return
        if not record.chunk_times:  # tokens that decoded to no text: they arrived by the end
            record.first_token = record.end
            record.chunk_times.append(record.end)
            record.chunk_tokens.append(total)
        elif progress.estimated:
            record.chunk_tokens[:] = _split(total, len(record.chunk_times))


def _observe(record: RequestRecord, progress: _Progress, chunk: StreamChunk, now: float) -> None:
    if chunk.has_choice:
        if chunk.completion_tokens is not None:  # a running count on every message
            num_tokens = chunk.completion_tokens - (progress.num_reported or 0)
        else:
            num_tokens = 1 if chunk.text else 0
            progress.estimated = progress.estimated or bool(chunk.text)
        if num_tokens > 0:
            if record.first_token is None:
                record.first_token = now
            record.chunk_times.append(now)
            record.chunk_tokens.append(num_tokens)
        progress.text.append(chunk.text)
        if record.json_schema is not None:
            record.text.append(chunk.text)
        if chunk.finish_reason is not None:
            record.finish_reason = chunk.finish_reason
    if chunk.prompt_tokens is not None:
        record.num_prompt_tokens = chunk.prompt_tokens
    if chunk.draft_tokens is not None:
        record.num_draft_tokens = chunk.draft_tokens
        record.num_accepted_tokens = chunk.accepted_tokens
    if chunk.completion_tokens is not None:
        progress.num_reported = chunk.completion_tokens


def _split(total: int, parts: int) -> list[int]:
    """`total` as `parts` integers that differ by at most one, larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]
