"""A small asyncio HTTP/1.1 client for `specserve bench serve --backend openai`: JSON
requests and Server-Sent Events answers over pooled keep-alive connections.

Only what a load generator for the OpenAI streaming API needs: one request per
connection at a time, Content-Length or chunked bodies (or a body that ends with the
connection), and the SSE `data:` field. The standard library has no asyncio HTTP
client, and the bench is part of the product, so this avoids a runtime dependency.

    async with client.request("POST", "/v1/completions", body) as response:
        async for data in response.sse_data():   # each event's data, e.g. '{"choices":...}'
            ...
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

_MAX_LINE = 1 << 20  # longest status, header or chunk-size line we accept


class HttpStatusError(Exception):
    """A non-2xx answer; `status` is its code, the message the start of its body."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:200]}")
        self.status = status


class ConnectError(OSError):
    """The server could not be reached (refused, unknown host, TLS handshake)."""


class Disconnected(Exception):
    """The connection ended before the response was complete."""


@dataclass(frozen=True)
class BaseUrl:
    scheme: str
    host: str
    port: int
    prefix: str  # path before /v1/..., without the trailing slash

    @property
    def authority(self) -> str:
        default = 443 if self.scheme == "https" else 80
        return self.host if self.port == default else f"{self.host}:{self.port}"


def parse_base_url(text: str) -> BaseUrl:
    """`http[s]://HOST[:PORT][/prefix]`; a trailing /v1 is dropped (the OpenAI SDKs'
    base URL carries it, the request paths here do too)."""
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--base-url must be http://HOST:PORT or https://HOST:PORT, got {text!r}")
    prefix = parts.path.rstrip("/")
    prefix = prefix[: -len("/v1")] if prefix.endswith("/v1") else prefix
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return BaseUrl(parts.scheme, parts.hostname, port, prefix)


class SseDecoder:
    """Server-Sent Events from the bytes of a body, piece by piece: `feed` returns the
    data (its `data:` lines joined by newlines) of each event a piece completes.
    Comments (`: ping`) and other fields are skipped; an event cut off by the end of the
    stream is dropped. Also used by the Locust file, over `requests`."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, piece: bytes) -> list[str]:
        *lines, self._buffer = (self._buffer + piece).split(b"\n")
        events = []
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8", "replace")
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                self._data = []
                continue
            field, _, value = line.partition(":")
            if field == "data":
                self._data.append(value[1:] if value.startswith(" ") else value)
        return events


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @property
    def usable(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof()

    def close(self) -> None:
        self.writer.close()


class Response:
    """Status, headers and the body of one answer, read as it arrives."""

    def __init__(self, conn: _Connection, status: int, headers: dict[str, str]) -> None:
        self.status, self.headers = status, headers
        self._conn = conn
        self.complete = False  # the whole body was read: the connection may be reused

    @property
    def keep_alive(self) -> bool:
        ends_with_close = "content-length" not in self.headers and not self._chunked
        return self.headers.get("connection", "").lower() != "close" and not ends_with_close

    @property
    def _chunked(self) -> bool:
        return "chunked" in self.headers.get("transfer-encoding", "").lower()

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        reader = self._conn.reader
        try:
            if self._chunked:
                async for piece in _chunks(reader):
                    yield piece
            elif "content-length" in self.headers:
                yield await reader.readexactly(int(self.headers["content-length"]))
            else:  # the body ends with the connection
                while piece := await reader.read(65536):
                    yield piece
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise Disconnected(f"connection closed mid-response ({type(exc).__name__})") from None
        self.complete = True

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.iter_bytes()])

    async def sse_data(self) -> AsyncIterator[str]:
        decoder = SseDecoder()
        async for piece in self.iter_bytes():
            for data in decoder.feed(piece):
                yield data


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The pieces of a chunked body, each as soon as it has arrived."""
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                pass
            return
        piece = await reader.readexactly(size)
        await reader.readexactly(2)  # the CRLF after the chunk
        yield piece


class HttpClient:
    """Requests to one server; idle connections are kept for the next request."""

    def __init__(
        self,
        base_url: str,
        headers: dict[str, str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        server_name: str | None = None,
    ) -> None:
        self.url = parse_base_url(base_url)
        self._headers = headers or {}
        self._ssl = ssl_context or (ssl.create_default_context() if self._tls else None)
        self._server_name = server_name
        self._idle: list[_Connection] = []

    @property
    def _tls(self) -> bool:
        return self.url.scheme == "https"

    @contextlib.asynccontextmanager
    async def request(
        self, method: str, path: str, body: dict | None = None
    ) -> AsyncIterator[Response]:
        """The answer's status and headers, its body left to read. The connection goes
        back to the pool only if the body was read to its end; otherwise it is closed,
        which tells the server the client has gone (an abandoned stream is aborted)."""
        payload = self._encode(method, path, body)
        conn, response = await self._send(payload)
        try:
            yield response
        finally:
            if response.complete and response.keep_alive and conn.usable:
                self._idle.append(conn)
            else:
                conn.close()

    async def get_json(self, path: str) -> tuple[int, object]:
        async with self.request("GET", path) as response:
            text = (await response.read()).decode("utf-8", "replace")
        try:
            return response.status, json.loads(text)
        except ValueError:
            return response.status, text

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    async def _send(self, payload: bytes) -> tuple[_Connection, Response]:
        while self._idle:
            conn = self._idle.pop()
            if not conn.usable:
                conn.close()
                continue
            try:
                return conn, await _exchange(conn, payload)
            except (Disconnected, ConnectionError):
                # The server closed this idle connection (its keep-alive timeout) before
                # reading the request: nothing was processed, try a fresh connection.
                conn.close()
            except BaseException:  # cancelled (a timeout) while waiting for the answer
                conn.close()
                raise
        conn = await self._connect()
        try:
            return conn, await _exchange(conn, payload)
        except BaseException:
            conn.close()
            raise

    async def _connect(self) -> _Connection:
        try:
            reader, writer = await asyncio.open_connection(
                self.url.host,
                self.url.port,
                ssl=self._ssl,
                server_hostname=(self._server_name or self.url.host) if self._ssl else None,
                limit=_MAX_LINE,
            )
        except (OSError, ssl.SSLError) as exc:
            raise ConnectError(f"{self.url.host}:{self.url.port}: {exc}") from None
        return _Connection(reader, writer)

    def _encode(self, method: str, path: str, body: dict | None) -> bytes:
        data = b"" if body is None else json.dumps(body).encode()
        headers = {
            "Host": self.url.authority,
            "Accept": "text/event-stream, application/json",
            **self._headers,
        }
        if body is not None:
            headers["Content-Type"] = "application/json"
            headers["Content-Length"] = str(len(data))
        head = f"{method} {self.url.prefix}{path} HTTP/1.1\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        return (head + "\r\n").encode("latin-1") + data


async def _exchange(conn: _Connection, payload: bytes) -> Response:
    """Send one request and read the answer's head."""
    conn.writer.write(payload)
    await conn.writer.drain()
    try:
        status_line = await conn.reader.readuntil(b"\r\n")
        headers = {}
        while (line := await conn.reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
    except asyncio.IncompleteReadError:
        raise Disconnected("connection closed before the response head") from None
    parts = status_line.decode("latin-1").split(None, 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise Disconnected(f"not an HTTP response: {status_line[:80]!r}")
    return Response(conn, int(parts[1]), headers)
