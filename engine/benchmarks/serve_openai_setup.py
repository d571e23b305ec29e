"""Setting up `specserve bench serve --backend openai`: the flags, the model the server
lists (waiting for one), the tokenizer on the client and the connection. The requests
themselves: engine/benchmarks/serve_openai.py."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ssl
import sys
from collections.abc import AsyncIterator

from engine.benchmarks.serve_http import ConnectError, Disconnected, HttpClient
from engine.benchmarks.serve_openai import OpenAIOptions, OpenAITransport
from engine.benchmarks.serve_sweep import build_workload

_POLL_INTERVAL_S = 0.5
_POLL_TIMEOUT_S = 5.0


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
