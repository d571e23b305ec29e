"""A small typed client for specserve's gRPC API (sync and asyncio).

    with SpecserveClient("localhost:50051") as client:
        for delta in client.generate("The capital of France is", max_tokens=16):
            print(delta.text, end="", flush=True)

Errors are ``grpc.RpcError`` (``.code()``, ``.details()``); ``retry_after_s(error)``
reads the server's retry hint from a RESOURCE_EXHAUSTED answer.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.outputs import TokenLogprob
from engine.rpc import generation_pb2 as pb
from engine.rpc import generation_pb2_grpc as pb_grpc

SERVICE_NAME = "specserve.v1.Generation"
_FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


# ---- typed results ----------------------------------------------------------------
@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    draft_tokens: int
    accepted_draft_tokens: int
    time_to_first_token_s: float


@dataclass(slots=True)
class GenerateDelta:
    """One streamed chunk. ``finish_reason`` and ``usage`` are set on the last one only."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    usage: Usage | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    usage: Usage | None
    stop_reason: str | int | None = None


@dataclass(frozen=True)
class TlsConfig:
    """PEM bytes or file paths. No ca_cert: the system roots. Client cert+key: mTLS."""

    ca_cert: bytes | str | None = None
    client_cert: bytes | str | None = None
    client_key: bytes | str | None = None
    # Expected server name when it differs from the target's host (tests, IPs).
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_pem(self.ca_cert),
            private_key=_pem(self.client_key),
            certificate_chain=_pem(self.client_cert),
        )


# ---- requests -----------------------------------------------------------------------
def build_request(
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Sequence[dict[str, str]] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    top_logprobs: int | None = None,
    num_speculative_tokens: int | None = None,
    priority: int = 0,
    request_id: str | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest from plain values. ``num_speculative_tokens``: None = server
    policy, 0 = off, k = exactly k draft tokens per step."""
    request = pb.GenerateRequest(priority=priority)
    if request_id is not None:
        request.request_id = request_id
    if messages is not None:
        request.chat.messages.extend(pb.ChatMessage(**m) for m in messages)
    elif isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.ids.extend(prompt)
    s = request.sampling
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_k", top_k),
        ("top_p", top_p),
        ("min_p", min_p),
        ("seed", seed),
        ("top_logprobs", top_logprobs),
    ):
        if value is not None:
            setattr(s, name, value)
    s.stop.extend(stop)
    s.stop_token_ids.extend(stop_token_ids)
    s.ignore_eos = ignore_eos
    if num_speculative_tokens == 0:
        request.speculation.mode = pb.SpeculationOptions.MODE_OFF
    elif num_speculative_tokens is not None:
        request.speculation.mode = pb.SpeculationOptions.MODE_FIXED
        request.speculation.num_speculative_tokens = num_speculative_tokens
    return request


def retry_after_s(error: grpc.RpcError) -> float | None:
    """The server's retry hint (trailing metadata ``retry-after-ms``), if any."""
    for key, value in error.trailing_metadata() or ():
        if key == "retry-after-ms":
            return int(value) / 1000
    return None


# ---- conversions --------------------------------------------------------------------
def _delta(r: pb.GenerateResponse) -> GenerateDelta:
    return GenerateDelta(
        request_id=r.request_id,
        text=r.text,
        token_ids=list(r.token_ids),
        logprobs=_logprobs(r.logprobs),
        finish_reason=_FINISH_REASONS.get(r.finish_reason),
        usage=_usage(r) if r.HasField("usage") else None,
        stop_reason=_stop_reason(r),
    )


def _completion(r: pb.GenerateCompleteResponse) -> Completion:
    return Completion(
        request_id=r.request_id,
        text=r.text,
        token_ids=list(r.token_ids),
        logprobs=_logprobs(r.logprobs),
        finish_reason=_FINISH_REASONS.get(r.finish_reason),
        usage=_usage(r) if r.HasField("usage") else None,
        stop_reason=_stop_reason(r),
    )


def _usage(r: pb.GenerateResponse | pb.GenerateCompleteResponse) -> Usage:
    u = r.usage
    return Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        cached_prompt_tokens=u.cached_prompt_tokens,
        draft_tokens=u.draft_tokens,
        accepted_draft_tokens=u.accepted_draft_tokens,
        time_to_first_token_s=u.time_to_first_token_s,
    )


def _logprobs(entries) -> list[TokenLogprob]:
    return [
        TokenLogprob(e.token_id, e.logprob, [(t.token_id, t.logprob) for t in e.top])
        for e in entries
    ]


def _stop_reason(r) -> str | int | None:
    kind = r.WhichOneof("stop_reason")
    return None if kind is None else getattr(r, kind)


def _pem(value: bytes | str | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


def _health_status(response: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


# ---- sync client --------------------------------------------------------------------
class GenerateStream:
    """Iterate for deltas; ``cancel()`` aborts the request on the server."""

    def __init__(self, call) -> None:
        self._call = call

    def __iter__(self) -> Iterator[GenerateDelta]:
        for response in self._call:
            yield _delta(response)

    def cancel(self) -> None:
        self._call.cancel()


class SpecserveClient:
    """Blocking client. ``tls``: False (plaintext), True (system roots) or a TlsConfig."""

    def __init__(
        self,
        target: str,
        api_key: str | None = None,
        tls: bool | TlsConfig = False,
        options: Sequence[tuple[str, object]] = (),
    ) -> None:
        self._target = target
        self._channel = _make_channel(grpc, target, tls, options)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = _auth_metadata(api_key)

    def generate(
        self, prompt=None, *, request: pb.GenerateRequest | None = None, timeout=None, **kwargs
    ) -> GenerateStream:
        request = request or build_request(prompt, **kwargs)
        return GenerateStream(
            self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        )

    def generate_complete(
        self, prompt=None, *, request: pb.GenerateRequest | None = None, timeout=None, **kwargs
    ) -> Completion:
        request = request or build_request(prompt, **kwargs)
        return _completion(
            self._stub.GenerateComplete(request, timeout=timeout, metadata=self._metadata)
        )

    def tokenize(
        self, text: str | None = None, *, messages=None, timeout: float | None = None
    ) -> list[int]:
        request = _tokenize_request(text, messages)
        response = self._stub.Tokenize(request, timeout=timeout, metadata=self._metadata)
        return list(response.token_ids)

    def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return self._stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=timeout, metadata=self._metadata
        )

    def server_stats(self, timeout: float | None = None) -> pb.ServerStats:
        return self._stub.GetServerStats(
            pb.GetServerStatsRequest(), timeout=timeout, metadata=self._metadata
        )

    def health(self, service: str = SERVICE_NAME, timeout: float | None = 5.0) -> str:
        """'SERVING', 'NOT_SERVING', ... (health needs no API key)."""
        request = health_pb2.HealthCheckRequest(service=service)
        return _health_status(self._health.Check(request, timeout=timeout))

    def wait_serving(self, timeout: float = 60.0) -> None:
        """Poll health until SERVING; TimeoutError (naming the last answer) otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                last = self.health(timeout=1.0)
            except grpc.RpcError as exc:  # refused or unavailable while the server starts
                last = exc.code().name
            if last == "SERVING":
                return
            if time.monotonic() > deadline:
                raise _not_serving(self._target, timeout, last)
            time.sleep(0.1)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> SpecserveClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- async client -------------------------------------------------------------------
class AsyncGenerateStream:
    def __init__(self, call) -> None:
        self._call = call

    async def __aiter__(self) -> AsyncIterator[GenerateDelta]:
        async for response in self._call:
            yield _delta(response)

    def cancel(self) -> None:
        self._call.cancel()


class AsyncSpecserveClient:
    """The asyncio twin of SpecserveClient (create it inside a running event loop)."""

    def __init__(
        self,
        target: str,
        api_key: str | None = None,
        tls: bool | TlsConfig = False,
        options: Sequence[tuple[str, object]] = (),
    ) -> None:
        self._target = target
        self._channel = _make_channel(grpc.aio, target, tls, options)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = _auth_metadata(api_key)

    def generate(
        self, prompt=None, *, request: pb.GenerateRequest | None = None, timeout=None, **kwargs
    ) -> AsyncGenerateStream:
        request = request or build_request(prompt, **kwargs)
        return AsyncGenerateStream(
            self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        )

    async def generate_complete(
        self, prompt=None, *, request: pb.GenerateRequest | None = None, timeout=None, **kwargs
    ) -> Completion:
        request = request or build_request(prompt, **kwargs)
        response = await self._stub.GenerateComplete(
            request, timeout=timeout, metadata=self._metadata
        )
        return _completion(response)

    async def tokenize(
        self, text: str | None = None, *, messages=None, timeout: float | None = None
    ) -> list[int]:
        request = _tokenize_request(text, messages)
        response = await self._stub.Tokenize(request, timeout=timeout, metadata=self._metadata)
        return list(response.token_ids)

    async def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return await self._stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=timeout, metadata=self._metadata
        )

    async def server_stats(self, timeout: float | None = None) -> pb.ServerStats:
        return await self._stub.GetServerStats(
            pb.GetServerStatsRequest(), timeout=timeout, metadata=self._metadata
        )

    async def health(self, service: str = SERVICE_NAME, timeout: float | None = 5.0) -> str:
        request = health_pb2.HealthCheckRequest(service=service)
        return _health_status(await self._health.Check(request, timeout=timeout))

    async def wait_serving(self, timeout: float = 60.0) -> None:
        """Poll health until SERVING; TimeoutError (naming the last answer) otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                last = await self.health(timeout=1.0)
            except grpc.RpcError as exc:  # refused or unavailable while the server starts
                last = exc.code().name
            if last == "SERVING":
                return
            if time.monotonic() > deadline:
                raise _not_serving(self._target, timeout, last)
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncSpecserveClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _not_serving(target: str, timeout: float, last: str) -> TimeoutError:
    return TimeoutError(
        f"server {target} not SERVING after {timeout:.0f}s (last health answer: {last})"
    )


def _make_channel(module, target: str, tls: bool | TlsConfig, options):
    options = list(options)
    if tls is False:
        return module.insecure_channel(target, options=options)
    config = TlsConfig() if tls is True else tls
    if config.server_name:
        options.append(("grpc.ssl_target_name_override", config.server_name))
    return module.secure_channel(target, config.credentials(), options=options)


def _auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def _tokenize_request(text: str | None, messages) -> pb.TokenizeRequest:
    if messages is not None:
        return pb.TokenizeRequest(
            chat=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages])
        )
    return pb.TokenizeRequest(text=text or "")


# ---- CLI ----------------------------------------------------------------------------
def stream_generate_cli(
    server: str,
    prompt: str,
    max_tokens: int,
    temperature: float,
    seed: int | None,
    chat: bool,
    api_key: str | None,
) -> int:
    """``specserve generate --server HOST:PORT``: stream text to stdout; 0 on success."""
    kwargs = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    try:
        with SpecserveClient(server, api_key=api_key) as client:
            stream = client.generate(
                **kwargs, max_tokens=max_tokens, temperature=temperature, seed=seed
            )
            for delta in stream:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
    except grpc.RpcError as exc:
        sys.stdout.write("\n")
        print(f"specserve generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    return 0
