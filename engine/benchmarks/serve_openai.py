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
local directory or a hub id), as the server's Tokenize RPC is not part of the OpenAI API.

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

import argparse
import asyncio
import contextlib
import json
import ssl
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.benchmarks.serve_http import (
    ConnectError,
    Disconnected,
    HttpClient,
    HttpStatusError,
)
from engine.benchmarks.serve_stats import RequestRecord
from engine.benchmarks.serve_sweep import build_workload
from engine.benchmarks.serve_workload import BenchRequest

ENDPOINTS = ("auto", "chat", "completions")
_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
_POLL_INTERVAL_S = 0.5
_POLL_TIMEOUT_S = 5.0


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
        endpoint = self.endpoint_for(req)
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
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


# ---- the tokenizer on the client -----------------------------------------------------
class LocalTokenizer:
    """The model's tokenizer, loaded on first use (only synthetic and ShareGPT need it)."""

    def __init__(self, name: str, flag_given: bool) -> None:
        self._name, self._flag_given = name, flag_given
        self._tokenizer = None

    def _get(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self._name)
            except Exception as exc:  # noqa: BLE001 - any load failure is one line
                source = "--tokenizer" if self._flag_given else "the served model name"
                raise ValueError(
                    f"cannot load a tokenizer from {source} {self._name!r} "
                    f"({type(exc).__name__}); the synthetic and sharegpt datasets over "
                    "--backend openai need --tokenizer DIR_OR_HUB_ID (or use --dataset chat)"
                ) from None
        return self._tokenizer

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    def encode(self, text: str) -> list[int]:
        return list(self._get().encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self._get().decode(ids)

    async def tokenize(
        self, text: str | None = None, *, messages=None, timeout: float | None = None
    ) -> list[int]:
        tokenizer = self._get()
        if messages is not None and tokenizer.chat_template is not None:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        elif messages is not None:
            text = "\n".join(m["content"] for m in messages)
        return self.encode(text or "")


# ---- connecting ----------------------------------------------------------------------
async def find_model(client: HttpClient, wanted: str | None, wait_s: float) -> dict:
    """The /v1/models entry to load-test, waiting up to `wait_s` for the server to list
    one (a gateway lists nothing until a worker has registered)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    target = f"{client.url.scheme}://{client.url.authority}{client.url.prefix}"
    announced = False
    while True:
        answer = await _models_or_reason(client)
        if isinstance(answer, list):
            return _pick(answer, wanted, target)
        if answer.startswith(("HTTP 401", "HTTP 403")):
            raise ValueError(f"{target} refused the request ({answer}): check --api-key")
        if loop.time() > deadline:
            raise TimeoutError(
                f"server {target} lists no model after {wait_s:.0f}s (last answer: {answer})"
            )
        if not announced:
            print(f"waiting for {target} to list a model...", file=sys.stderr, flush=True)
            announced = True
        await asyncio.sleep(_POLL_INTERVAL_S)


async def _models_or_reason(client: HttpClient) -> list[dict] | str:
    try:
        status, body = await asyncio.wait_for(client.get_json("/v1/models"), _POLL_TIMEOUT_S)
    except ConnectError as exc:
        return f"CONNECT_ERROR ({exc})"
    except (Disconnected, ConnectionError):
        return "DISCONNECTED"
    except asyncio.TimeoutError:
        return "TIMEOUT"
    if status != 200:
        code = body.get("error", {}).get("code") if isinstance(body, dict) else None
        return f"HTTP {status}" + (f" {code}" if code else "")
    entries = body.get("data") if isinstance(body, dict) else None
    return entries if entries else "no model listed"


def _pick(entries: list[dict], wanted: str | None, target: str) -> dict:
    ids = [e.get("id") for e in entries]
    if wanted is not None:
        if wanted not in ids:
            raise ValueError(f"--model-name {wanted!r} is not served by {target}; it serves {ids}")
        return entries[ids.index(wanted)]
    if len(entries) > 1:
        raise ValueError(f"{target} serves {len(ids)} models {ids}: choose one with --model-name")
    return entries[0]


def _max_model_len(entry: dict) -> int:
    for key in ("max_model_len", "context_length", "max_context_length"):
        if isinstance(entry.get(key), int):
            return entry[key]
    return sys.maxsize  # unknown: the server refuses what does not fit, counted as errors


def ssl_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    files = (args.tls_ca_cert, args.tls_client_cert, args.tls_client_key)
    if not args.base_url.lower().startswith("https://"):
        if args.tls or any(files) or args.tls_server_name:
            raise ValueError("--tls* flags need an https:// --base-url")
        return None
    context = ssl.create_default_context(cafile=args.tls_ca_cert)
    if args.tls_client_cert:
        context.load_cert_chain(args.tls_client_cert, args.tls_client_key)
    return context


def check_flags(args: argparse.Namespace) -> None:
    if not args.base_url:
        raise ValueError("--backend openai needs --base-url http://HOST:PORT")
    if args.server:
        raise ValueError("--server is for --backend grpc; --backend openai takes --base-url")
    if args.num_speculative_tokens is not None:
        raise ValueError("--num-speculative-tokens needs --backend grpc (no OpenAI field)")
    if args.num_channels != 1:
        raise ValueError("--num-channels applies to --backend grpc (HTTP pools connections)")


@contextlib.asynccontextmanager
async def connect(args: argparse.Namespace, api_key: str | None) -> AsyncIterator[tuple]:
    """(transport, workload, server info) for `bench serve --backend openai`."""
    check_flags(args)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = HttpClient(args.base_url, headers, ssl_context(args), args.tls_server_name)
    try:
        entry = await find_model(client, args.model_name, args.wait_ready)
        model = entry["id"]
        tokenizer = LocalTokenizer(args.tokenizer or model, args.tokenizer is not None)
        workload = await build_workload(args, tokenizer, _max_model_len(entry))
        options = OpenAIOptions(
            model=model,
            endpoint=args.endpoint,
            temperature=args.temperature,
            ignore_eos=not args.no_ignore_eos,
            chat_template=not args.no_chat_template,
            timeout_s=args.request_timeout,
        )
        info = {"backend": "openai", "model": model, "endpoint": args.endpoint,
                "max_model_len": entry.get("max_model_len")}  # fmt: skip
        yield OpenAITransport(client, options, tokenizer), workload, info
    finally:
        await client.close()
