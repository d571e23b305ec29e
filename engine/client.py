"""A small typed client for specserve's gRPC API (sync and asyncio).

    with SpecserveClient("localhost:50051") as client:
        for delta in client.generate("The capital of France is", max_tokens=16):
            print(delta.text, end="", flush=True)

Errors are ``grpc.RpcError`` (``.code()``, ``.details()``); ``retry_after_s(error)``
reads the server's retry hint from a RESOURCE_EXHAUSTED answer.

Both clients share one request/response layer: each unary RPC is an ``_Rpc`` (what to
call, what to send, how to read the answer), built and converted the same way for
both; the two classes only differ in how they wait for the answer (block or await).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.io.outputs import TokenLogprob
from engine.rpc import generation_pb2 as pb
from engine.rpc import generation_pb2_grpc as pb_grpc

SERVICE_NAME = "specserve.v1.Generation"
_FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}
_POLL_INTERVAL_S = 0.1  # wait_serving: between health checks
_POLL_TIMEOUT_S = 1.0  # wait_serving: per health check


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
    # Why a constrained output may not satisfy its constraint (set on the last chunk).
    finish_detail: str | None = None

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
    finish_detail: str | None = None


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
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    repetition_penalty: float | None = None,
    min_tokens: int = 0,
    logit_bias: Mapping[int, float] | None = None,
    include_stop_str_in_output: bool = False,
    truncate_prompt_tokens: int | None = None,
    structured_output: Mapping[str, Any] | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest from plain values. ``num_speculative_tokens``: None = server
    policy, 0 = off, k = exactly k draft tokens per step. None leaves an option to the
    server's default. ``structured_output``: one constraint as a dict, e.g.
    ``{"json_schema": {...}}`` (a dict or JSON text), ``{"regex": "..."}``,
    ``{"choice": ["yes", "no"]}``, ``{"grammar": "..."}``, ``{"json_object": True}``."""
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
        ("repetition_penalty", repetition_penalty),
        ("truncate_prompt_tokens", truncate_prompt_tokens),
    ):
        if value is not None:
            setattr(s, name, value)
    s.stop.extend(stop)
    s.stop_token_ids.extend(stop_token_ids)
    s.ignore_eos = ignore_eos
    s.frequency_penalty = frequency_penalty
    s.presence_penalty = presence_penalty
    s.min_tokens = min_tokens
    s.logit_bias.update(logit_bias or {})
    s.include_stop_str_in_output = include_stop_str_in_output
    if structured_output is not None:
        s.structured_output.CopyFrom(_structured_output(structured_output))
    if num_speculative_tokens == 0:
        request.speculation.mode = pb.SpeculationOptions.MODE_OFF
    elif num_speculative_tokens is not None:
        request.speculation.mode = pb.SpeculationOptions.MODE_FIXED
        request.speculation.num_speculative_tokens = num_speculative_tokens
    return request


def _structured_output(constraint: Mapping[str, Any]) -> pb.StructuredOutput:
    if len(constraint) != 1:
        raise ValueError(
            f"structured_output must hold one constraint, got {sorted(constraint) or 'none'}"
        )
    ((kind, value),) = constraint.items()
    if kind == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    if kind == "choice":
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=list(value)))
    if kind not in pb.StructuredOutput.DESCRIPTOR.fields_by_name:
        raise ValueError(f"structured_output: unknown constraint {kind!r}")
    return pb.StructuredOutput(**{kind: value})


def retry_after_s(error: grpc.RpcError) -> float | None:
    """The server's retry hint (trailing metadata ``retry-after-ms``), if any."""
    for key, value in error.trailing_metadata() or ():
        if key == "retry-after-ms":
            return int(value) / 1000
    return None


@dataclass(frozen=True, slots=True)
class _Rpc:
    """One unary call, whichever transport carries it."""

    method: str  # the stub's method name
    request: Any  # the request message
    convert: Callable[[Any], Any]  # response message -> what the client returns
    health: bool = False  # the Health service: its own stub, no API key


def _generate_complete_rpc(prompt, request: pb.GenerateRequest | None, kwargs) -> _Rpc:
    return _Rpc("GenerateComplete", request or build_request(prompt, **kwargs), _completion)


def _tokenize_rpc(text: str | None, messages) -> _Rpc:
    if messages is not None:
        chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages])
        request = pb.TokenizeRequest(chat=chat)
    else:
        request = pb.TokenizeRequest(text=text or "")
    return _Rpc("Tokenize", request, lambda r: list(r.token_ids))


def _model_info_rpc() -> _Rpc:
    return _Rpc("GetModelInfo", pb.GetModelInfoRequest(), _same)


def _server_stats_rpc() -> _Rpc:
    return _Rpc("GetServerStats", pb.GetServerStatsRequest(), _same)


def _health_rpc(service: str) -> _Rpc:
    request = health_pb2.HealthCheckRequest(service=service)
    return _Rpc("Check", request, _health_status, health=True)


class _ServingWait:
    """wait_serving's rule for both transports: done at SERVING, TimeoutError (naming
    the last answer) once the deadline has passed."""

    def __init__(self, target: str, timeout: float) -> None:
        self._target, self._timeout = target, timeout
        self._deadline = time.monotonic() + timeout

    def done(self, last: str) -> bool:
        if last == "SERVING":
            return True
        if time.monotonic() > self._deadline:
            raise TimeoutError(
                f"server {self._target} not SERVING after {self._timeout:.0f}s "
                f"(last health answer: {last})"
            )
        return False


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
        finish_detail=r.finish_detail or None,
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
        finish_detail=r.finish_detail or None,
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


def _health_status(response: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def _same(response):
    return response


def _pem(value: bytes | str | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


# ---- transports ---------------------------------------------------------------------
class _Transport:
    """The channel, stubs and credentials; ``_start`` issues an ``_Rpc`` and returns
    the call (a response for grpc, an awaitable for grpc.aio)."""

    _grpc: Any  # the grpc module (blocking) or grpc.aio

    def __init__(
        self,
        target: str,
        api_key: str | None = None,
        tls: bool | TlsConfig = False,
        options: Sequence[tuple[str, object]] = (),
    ) -> None:
        self._target = target
        self._channel = _make_channel(self._grpc, target, tls, options)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = _auth_metadata(api_key)

    def _start(self, rpc: _Rpc, timeout: float | None):
        stub = self._health if rpc.health else self._stub
        metadata = None if rpc.health else self._metadata
        return getattr(stub, rpc.method)(rpc.request, timeout=timeout, metadata=metadata)

    def _start_stream(self, prompt, request: pb.GenerateRequest | None, timeout, kwargs):
        request = request or build_request(prompt, **kwargs)
        return self._stub.Generate(request, timeout=timeout, metadata=self._metadata)


class _Stream:
    def __init__(self, call) -> None:
        self._call = call

    def cancel(self) -> None:
        """Abort the request on the server."""
        self._call.cancel()


class GenerateStream(_Stream):
    """Iterate for deltas; ``cancel()`` aborts the request on the server."""

    def __iter__(self) -> Iterator[GenerateDelta]:
        for response in self._call:
            yield _delta(response)


class AsyncGenerateStream(_Stream):
    async def __aiter__(self) -> AsyncIterator[GenerateDelta]:
        async for response in self._call:
            yield _delta(response)


class SpecserveClient(_Transport):
    """Blocking client. ``tls``: False (plaintext), True (system roots) or a TlsConfig."""

    _grpc = grpc

    def _call(self, rpc: _Rpc, timeout: float | None):
        return rpc.convert(self._start(rpc, timeout))

    def generate(
        self, prompt=None, *, request: pb.GenerateRequest | None = None, timeout=None, **kwargs
    ) -> GenerateStream:
        return GenerateStream(self._start_stream(prompt, request, timeout, kwargs))

    def generate_complete(
        self, prompt=None, *, request: pb.GenerateRequest | None = None, timeout=None, **kwargs
    ) -> Completion:
        return self._call(_generate_complete_rpc(prompt, request, kwargs), timeout)

    def tokenize(
        self, text: str | None = None, *, messages=None, timeout: float | None = None
    ) -> list[int]:
        return self._call(_tokenize_rpc(text, messages), timeout)

    def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return self._call(_model_info_rpc(), timeout)

    def server_stats(self, timeout: float | None = None) -> pb.ServerStats:
        return self._call(_server_stats_rpc(), timeout)

    def health(self, service: str = SERVICE_NAME, timeout: float | None = 5.0) -> str:
        """'SERVING', 'NOT_SERVING', ... (health needs no API key)."""
        return self._call(_health_rpc(service), timeout)

    def wait_serving(self, timeout: float = 60.0) -> None:
        """Poll health until SERVING; TimeoutError (naming the last answer) otherwise."""
        wait = _ServingWait(self._target, timeout)
        while not wait.done(self._health_or_error()):
            time.sleep(_POLL_INTERVAL_S)

    def _health_or_error(self) -> str:
        try:
            return self.health(timeout=_POLL_TIMEOUT_S)
        except grpc.RpcError as exc:  # refused or unavailable while the server starts
            return exc.code().name

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> SpecserveClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncSpecserveClient(_Transport):
    """The asyncio twin of SpecserveClient (create it inside a running event loop)."""

    _grpc = grpc.aio

    async def _call(self, rpc: _Rpc, timeout: float | None):
        return rpc.convert(await self._start(rpc, timeout))

    def generate(
        self, prompt=None, *, request: pb.GenerateRequest | None = None, timeout=None, **kwargs
    ) -> AsyncGenerateStream:
        return AsyncGenerateStream(self._start_stream(prompt, request, timeout, kwargs))

    async def generate_complete(
        self, prompt=None, *, request: pb.GenerateRequest | None = None, timeout=None, **kwargs
    ) -> Completion:
        return await self._call(_generate_complete_rpc(prompt, request, kwargs), timeout)

    async def tokenize(
        self, text: str | None = None, *, messages=None, timeout: float | None = None
    ) -> list[int]:
        return await self._call(_tokenize_rpc(text, messages), timeout)

    async def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return await self._call(_model_info_rpc(), timeout)

    async def server_stats(self, timeout: float | None = None) -> pb.ServerStats:
        return await self._call(_server_stats_rpc(), timeout)

    async def health(self, service: str = SERVICE_NAME, timeout: float | None = 5.0) -> str:
        return await self._call(_health_rpc(service), timeout)

    async def wait_serving(self, timeout: float = 60.0) -> None:
        """Poll health until SERVING; TimeoutError (naming the last answer) otherwise."""
        wait = _ServingWait(self._target, timeout)
        while not wait.done(await self._health_or_error()):
            await asyncio.sleep(_POLL_INTERVAL_S)

    async def _health_or_error(self) -> str:
        try:
            return await self.health(timeout=_POLL_TIMEOUT_S)
        except grpc.RpcError as exc:  # refused or unavailable while the server starts
            return exc.code().name

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncSpecserveClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


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
