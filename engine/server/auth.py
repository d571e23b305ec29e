"""API-key authentication (a server interceptor) and TLS / mTLS credentials.

Each API key is one caller. The interceptor records which key an RPC presented
(``caller_id``), and the servicers scope request labels by it: a caller's Abort reaches
only the requests it submitted itself.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from pathlib import Path

import grpc

from engine.server.handlers import same_shape_handler

# Kubernetes probes and grpcurl's discovery must work without a key.
EXEMPT_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)

# The id of the key the current RPC presented. grpc.aio runs the interceptors and then
# the handler in one task per RPC, so what intercept_service sets, its handler reads.
_caller_id: ContextVar[str | None] = ContextVar("specserve_caller_id", default=None)


def caller_id() -> str | None:
    """The current RPC's caller: its API key's ``key_id``; None when the server takes
    no keys (every caller is the same one)."""
    return _caller_id.get()


def key_id(api_key: str) -> str:
    """A short name for a key, safe to log: a prefix of its SHA-256, never the key."""
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:8]


def load_api_key(api_key: str | None, api_key_file: str | None) -> str | tuple[str, ...] | None:
    """The key from --api-key, or the keys of --api-key-file (one a line, blank lines
    skipped; never both): one caller per key (see ``caller_id``)."""
    if api_key and api_key_file:
        raise ValueError("give --api-key or --api-key-file, not both")
    if api_key_file:
        keys = [line.strip() for line in Path(api_key_file).read_text().splitlines()]
        keys = [key for key in keys if key]
        if not keys:
            raise ValueError(f"--api-key-file {api_key_file} is empty")
        return keys[0] if len(keys) == 1 else tuple(keys)
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key must not be empty")
    return api_key


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Require ``authorization: Bearer <key>``, for one of ``api_keys``, on every RPC
    except health and reflection."""

    def __init__(
        self,
        api_keys: str | Sequence[str],
        report_error: Callable[[grpc.StatusCode, str, str | None], None] = (
            lambda code, details, request_id: None
        ),
    ) -> None:
        keys = (api_keys,) if isinstance(api_keys, str) else tuple(api_keys)
        if not keys or not all(keys):
            raise ValueError("api_keys must be one or more non-empty keys")
        self._expected = [f"Bearer {key}".encode() for key in keys]
        self._key_ids = [key_id(key) for key in keys]
        if len(set(self._key_ids)) != len(set(keys)):  # 1 in 2**32 per pair of keys
            raise ValueError("two API keys share a key_id: replace one of them")
        self._report_error = report_error

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(EXEMPT_PREFIXES):
            return await continuation(handler_call_details)
        caller = self._caller(handler_call_details)
        if caller is not None:
            _caller_id.set(caller)
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
            return None
        self._report_error(grpc.StatusCode.UNAUTHENTICATED, _DETAILS, None)
        return _unauthenticated_handler(handler)

    def _caller(self, handler_call_details) -> str | None:
        """The id of the key the call presented; None when it presented none we take."""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                # Every key compared: the time taken does not tell which one matched.
                matches = [hmac.compare_digest(given, expected) for expected in self._expected]
                return next((kid for kid, ok in zip(self._key_ids, matches) if ok), None)
        return None


_DETAILS = "missing or invalid API key: send metadata 'authorization: Bearer <key>'"


def _unauthenticated_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that refuses the call."""

    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DETAILS)

    async def refuse_stream(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DETAILS)
        yield  # unreachable: makes this an async generator, as streaming handlers are

    return same_shape_handler(handler, refuse_stream if handler.response_streaming else refuse)


def server_credentials(
    cert_file: str | None, key_file: str | None, client_ca_file: str | None
) -> grpc.ServerCredentials | None:
    """TLS when cert and key are given; mTLS (client certs required) with a client CA."""
    if not cert_file and not key_file:
        if client_ca_file:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (cert_file and key_file):
        raise ValueError("--tls-cert and --tls-key must be given together")
    pair = (Path(key_file).read_bytes(), Path(cert_file).read_bytes())
    root = Path(client_ca_file).read_bytes() if client_ca_file else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=root, require_client_auth=root is not None
    )
