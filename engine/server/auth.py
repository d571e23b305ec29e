"""API-key authentication (a server interceptor) and TLS / mTLS credentials."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from pathlib import Path

import grpc

from engine.server.handlers import same_shape_handler

# Kubernetes probes and grpcurl's discovery must work without a key.
EXEMPT_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)


def load_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """The key from --api-key or the first line of --api-key-file (never both)."""
    if api_key and api_key_file:
        raise ValueError("give --api-key or --api-key-file, not both")
    if api_key_file:
        lines = Path(api_key_file).read_text().splitlines()
        api_key = lines[0].strip() if lines else ""
        if not api_key:
            raise ValueError(f"--api-key-file {api_key_file} is empty")
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key must not be empty")
    return api_key


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Require ``authorization: Bearer <key>`` on every RPC except health and reflection."""

    def __init__(
        self,
        api_key: str,
        report_error: Callable[[grpc.StatusCode, str, str | None], None] = (
            lambda code, details, request_id: None
        ),
    ) -> None:
        self._expected = f"Bearer {api_key}".encode()
        self._report_error = report_error

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(EXEMPT_PREFIXES) or self._authorized(handler_call_details):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
            return None
        self._report_error(grpc.StatusCode.UNAUTHENTICATED, _DETAILS, None)
        return _unauthenticated_handler(handler)

    def _authorized(self, handler_call_details) -> bool:
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._expected)
        return False


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
