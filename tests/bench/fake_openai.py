"""A tiny OpenAI-compatible streaming server for the load-test tools' tests: known timing,
known chunks, and failures on chosen requests. Standard library only; one thread per
connection, HTTP/1.1 keep-alive, SSE bodies in chunked transfer encoding.

    with FakeOpenAI(ttft_s=0.2, itl_s=0.05, num_chunks=4, tokens_per_chunk=3) as server:
        server.url                      # http://127.0.0.1:PORT
        server.failures = {2: "429"}    # the 2nd generation request (1-based) answers 429

Each generation request streams (chat shown; /v1/completions streams "text" instead):

    wait ttft_s, then num_chunks messages itl_s apart, each with text "tok " * tokens_per_chunk
    a finish message (finish_reason "length", empty text), a usage message (choices [],
    usage.completion_tokens = num_chunks * tokens_per_chunk, 5 accepted and 3 rejected
    prediction tokens), then data: [DONE]

That is the shape the Shepherd Model Gateway 1.13 streams (checked against `smg launch`
with a stand-in vLLM engine worker): a first chat message with the role and empty
content, one message per worker chunk, the finish message, the usage message.

Failures: "429" / "500" (a JSON error answer), "drop" (the connection closes after two
messages), "error_event" (a `data: {"error": ...}` message after one message, then
[DONE]). `close_after_response` closes every connection after its answer without saying
so, as a server whose keep-alive timeout has passed would.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "fake-model"
PROMPT_TOKENS = 7
ACCEPTED_TOKENS, REJECTED_TOKENS = 5, 3


class FakeOpenAI:
    def __init__(
        self,
        ttft_s: float = 0.0,
        itl_s: float = 0.0,
        num_chunks: int = 4,
        tokens_per_chunk: int = 3,
        api_key: str | None = None,
        models_unavailable: int = 0,
    ) -> None:
        self.ttft_s, self.itl_s = ttft_s, itl_s
        self.num_chunks, self.tokens_per_chunk = num_chunks, tokens_per_chunk
        self.api_key = api_key
        self.models_unavailable = models_unavailable  # /v1/models answers 503 this often
        self.failures: dict[int, str] = {}
        self.close_after_response = False
        self.usage = True  # send the usage message
        self.requests: list[tuple[str, dict, dict]] = []  # (path, body, headers)
        self.num_connections = 0
        self.num_aborted = 0  # streams the client closed before their end
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def output_tokens(self) -> int:
        return self.num_chunks * self.tokens_per_chunk

    def __enter__(self) -> FakeOpenAI:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def arrive(self, path: str, body: dict, headers: dict) -> int:
        with self._lock:
            self.requests.append((path, body, headers))
            return len(self.requests)


def _handler(fake: FakeOpenAI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            with fake._lock:
                fake.num_connections += 1

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            if self.path != "/v1/models":
                return self._json(404, {"error": {"message": "no such path"}})
            if fake.models_unavailable > 0:
                fake.models_unavailable -= 1
                return self._json(503, {"error": {"code": "no_models_available"}})
            self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(length) or b"{}")
            if fake.api_key and self.headers.get("Authorization") != f"Bearer {fake.api_key}":
                return self._json(401, {"error": {"message": "bad key"}})
            number = fake.arrive(self.path, body, dict(self.headers))
            failure = fake.failures.get(number)
            if failure in ("429", "500"):
                return self._json(int(failure), {"error": {"message": f"injected {failure}"}})
            try:
                self._stream(body, self.path.endswith("/chat/completions"), failure)
            except (BrokenPipeError, ConnectionResetError):
                with fake._lock:
                    fake.num_aborted += 1
                self.close_connection = True
            if fake.close_after_response:
                self._drop()

        def _stream(self, body: dict, chat: bool, failure: str | None) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            if chat:
                self._event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            time.sleep(fake.ttft_s)
            for i in range(fake.num_chunks):
                if i:
                    time.sleep(fake.itl_s)
                self._event(_choice(chat, "tok " * fake.tokens_per_chunk, None))
                if failure == "drop" and i == 1:
                    return self._drop()
                if failure == "error_event":
                    self._event({"error": {"message": "engine failed", "code": 500}})
                    break
            self._event(_choice(chat, "", "length"))
            if fake.usage:
                prompt = PROMPT_TOKENS
                # The gateway's shape (smg 1.13): speculation in completion_tokens_details.
                details = {
                    "accepted_prediction_tokens": ACCEPTED_TOKENS,
                    "rejected_prediction_tokens": REJECTED_TOKENS,
                }
                usage = {"prompt_tokens": prompt, "completion_tokens": fake.output_tokens,
                         "total_tokens": prompt + fake.output_tokens,
                         "completion_tokens_details": details}  # fmt: skip
                self._event({"choices": [], "usage": usage})
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")

        def _event(self, obj: dict) -> None:
            self._chunk(f"data: {json.dumps(obj)}\n\n".encode())

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _drop(self) -> None:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

        def _json(self, status: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            if fake.close_after_response:
                self._drop()

    return Handler


def _choice(chat: bool, text: str, finish_reason: str | None) -> dict:
    choice = {"index": 0, "finish_reason": finish_reason}
    if chat:
        choice["delta"] = {"content": text} if text else {}
    else:
        choice["text"] = text
    return {"choices": [choice]}
