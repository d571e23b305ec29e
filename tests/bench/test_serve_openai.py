"""`specserve bench serve --backend openai` against a fake OpenAI streaming server with
known timing, chunks and failures (tests/bench/fake_openai.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import time
import warnings

import pytest

from engine.benchmarks import serve_workload as wl
from engine.benchmarks.serve_http import HttpClient, SseDecoder, parse_base_url
from engine.benchmarks.serve_openai import (
    OpenAIOptions,
    OpenAITransport,
    StreamError,
    _split,
    parse_chunk,
)
from engine.benchmarks.serve_openai_setup import LocalTokenizer
from engine.benchmarks.serve_runner import LoadGenerator, LoadShape
from engine.benchmarks.serve_stats import summarize
from engine.entrypoints.cli import main
from tests.bench.fake_openai import (
    ACCEPTED_TOKENS,
    MODEL,
    PROMPT_TOKENS,
    REJECTED_TOKENS,
    FakeOpenAI,
)


def text_workload(seed: int = 0):
    items = [wl.TextItem("Tell me a story"), wl.TextItem("Hi")]
    return wl.text_requests(items, wl.LengthDist(12), seed)


def run(server: FakeOpenAI, shape: LoadShape, requests=None, tokenizer=None, **options):
    async def go():
        client = HttpClient(server.url)
        transport = OpenAITransport(client, OpenAIOptions(model=MODEL, **options), tokenizer)
        try:
            return await LoadGenerator(transport).run(requests or text_workload(), shape)
        finally:
            await client.close()

    return asyncio.run(go())


def test_measured_ttft_itl_tpot_and_usage_match_the_stream():
    ttft_s, itl_s = 0.2, 0.05
    with FakeOpenAI(ttft_s=ttft_s, itl_s=itl_s, num_chunks=4, tokens_per_chunk=3) as server:
        records, duration = run(server, LoadShape(concurrency=2, num_requests=6))
        assert server.num_connections <= 2  # keep-alive: one connection per worker
    assert [r.index for r in records] == list(range(6))
    for r in records:
        assert r.ok and r.finish_reason == "length"
        # The clock starts before the request is sent: TTFT can only be longer.
        assert ttft_s <= r.ttft < ttft_s + 1.0
        assert r.chunk_tokens == [3, 3, 3, 3]  # usage 12 tokens over 4 text messages
        assert (r.num_output_tokens, r.num_prompt_tokens) == (12, PROMPT_TOKENS)
        assert len(r.itls) == 3 and min(r.itls) >= 0 and statistics.fmean(r.itls) >= 0.8 * itl_s
        assert max(r.itls) < itl_s + 0.5
        assert r.tpot == pytest.approx((r.e2e - r.ttft) / 11)
        assert (r.num_accepted_tokens, r.num_draft_tokens) == (5, 8)
    s = summarize(records, duration, {"ttft": 5000})
    assert s["num_completed"] == 6 and s["num_output_tokens"] == 72
    assert s["output_throughput"] == pytest.approx(72 / duration)
    assert s["goodput"] == pytest.approx(6 / duration)
    assert s["acceptance_rate"] == ACCEPTED_TOKENS / (ACCEPTED_TOKENS + REJECTED_TOKENS)
    path, body, _ = server.requests[0]
    assert path == "/v1/chat/completions"
    assert body["model"] == MODEL and body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"][0]["role"] == "user" and body["max_tokens"] == 12


def test_completions_without_usage_count_text_messages_or_retokenize(tiny_model_dir):
    with FakeOpenAI(num_chunks=4, tokens_per_chunk=3) as server:
        server.usage = False
        records, _ = run(server, LoadShape(concurrency=1, num_requests=2), chat_template=False)
        assert server.requests[0][0] == "/v1/completions"
        assert server.requests[0][1]["prompt"] in ("Tell me a story", "Hi")
        assert all(r.ok and r.chunk_tokens == [1, 1, 1, 1] for r in records)

        # Token prompts (synthetic) are decoded with the tokenizer, which then counts the
        # output when the server reports no usage: "tok " * 12 is 48 byte tokens.
        tokenizer = LocalTokenizer(tiny_model_dir, flag_given=True)
        ids = asyncio.run(tokenizer.tokenize("hello world"))
        prompts = iter([wl.BenchRequest(0, 8, token_ids=tuple(ids), num_prompt_tokens=len(ids))])
        records, _ = run(server, LoadShape(concurrency=1, num_requests=1), prompts, tokenizer)
        (r,) = records
        assert server.requests[-1][0] == "/v1/completions"
        assert server.requests[-1][1]["prompt"] == "hello world"
        assert r.ok and r.chunk_tokens == [12, 12, 12, 12]


def test_errors_are_counted_by_what_went_wrong():
    with FakeOpenAI(num_chunks=3) as server:
        server.failures = {2: "429", 3: "500", 5: "drop", 6: "error_event"}
        records, duration = run(server, LoadShape(concurrency=1, num_requests=8))
    assert [r.error for r in records] == [
        None, "HTTP_429", "HTTP_500", None, "DISCONNECTED", "STREAM_ERROR", None, None
    ]  # fmt: skip
    dropped = records[4]
    assert dropped.first_token is not None and not dropped.ok  # it had started
    s = summarize(records, duration, {})
    assert s["errors"] == {"HTTP_429": 1, "HTTP_500": 1, "DISCONNECTED": 1, "STREAM_ERROR": 1}
    assert s["num_completed"] == 4 and s["num_output_tokens"] == 4 * 9


def test_timeout_closes_the_stream_so_the_server_can_abort_it():
    with FakeOpenAI(itl_s=0.5, num_chunks=4) as server:
        records, _ = run(server, LoadShape(concurrency=1, num_requests=1), timeout_s=0.3)
        assert records[0].error == "TIMEOUT"
        deadline = time.monotonic() + 10
        while server.num_aborted == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.num_aborted == 1  # its next write found the connection closed


def test_a_reused_connection_the_server_closed_is_retried_on_a_new_one():
    """A keep-alive connection the server closes on reading the next request (its idle
    timeout raced the request) costs nothing: the request goes out again, once."""

    async def go():
        seen = {"connections": 0}

        async def handle(reader, writer):
            seen["connections"] += 1
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
            await reader.readuntil(b"\r\n\r\n")  # the second request on it: close instead
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = HttpClient(f"http://127.0.0.1:{port}")
        try:
            answers = [await client.get_json("/v1/models") for _ in range(3)]
        finally:
            await client.close()
            server.close()
        return answers, seen["connections"]

    answers, connections = asyncio.run(go())
    assert answers == [(200, {})] * 3 and connections == 3


def test_a_request_cancelled_on_a_reused_connection_closes_it():
    """A timeout while a reused connection waits for its answer must close it, or the
    server would keep working for a client that has gone."""

    async def go():
        closed = asyncio.Event()

        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await reader.readuntil(b"\r\n\r\n")  # the second request: no answer
            await reader.read()  # until the client closes
            closed.set()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = HttpClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        try:
            assert await client.get_json("/v1/models") == (200, {})
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.get_json("/v1/models"), 0.2)
            await asyncio.wait_for(closed.wait(), 10)
        finally:
            await client.close()
            server.close()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(go())
    # Closed by the client, not left to the garbage collector ("unclosed transport").
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


def test_cli_waits_for_a_model_then_runs_closed_open_and_sweep(tmp_path, capsys):
    with FakeOpenAI(ttft_s=0.01, num_chunks=3, api_key="k3y", models_unavailable=2) as server:
        out = tmp_path / "sweep.json"
        argv = ["bench", "serve", "--backend", "openai", "--base-url", server.url + "/v1",
                "--api-key", "k3y", "--dataset", "chat", "--sweep", "1,2", "--num-requests",
                "4", "--slo", "ttft=5000,tpot=1000", "--rate-search-steps", "1",
                "--no-progress", "--json", str(out)]  # fmt: skip
        assert main(argv) == 0
        assert all(h["Authorization"] == "Bearer k3y" for _, _, h in server.requests)
    result = json.loads(out.read_text())
    assert result["server"] == {"backend": "openai", "model": MODEL, "endpoint": "auto",
                                "max_model_len": None}  # fmt: skip
    assert [lv["summary"]["num_completed"] for lv in result["levels"]] == [4, 4]
    (rate_run,) = result["rate_search"]["runs"]
    assert rate_run["summary"]["num_completed"] == 4 and rate_run["meets_slo"]
    captured = capsys.readouterr()
    assert f"waiting for {server.url} to list a model..." in captured.err
    assert f"OpenAI API {server.url}/v1: model {MODEL}" in captured.out
    assert "knee" in captured.out


def test_synthetic_prompts_over_openai_have_the_input_length(tiny_model_dir, tmp_path):
    with FakeOpenAI(num_chunks=2) as server:
        argv = ["bench", "serve", "--backend", "openai", "--base-url", server.url,
                "--tokenizer", tiny_model_dir, "--input-len", "24", "--num-requests", "3",
                "--no-progress", "--json", str(tmp_path / "s.json")]  # fmt: skip
        assert main(argv) == 0
        prompts = [body["prompt"] for path, body, _ in server.requests]
    # A byte-level tokenizer and an ASCII corpus: 24 tokens are 24 characters.
    assert len(prompts) == 3 and all(len(p) == 24 for p in prompts)


def test_flag_and_connection_errors_are_one_line(capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cases = [
        (["--backend", "openai"], "--backend openai needs --base-url http://HOST:PORT"),
        (["--backend", "openai", "--base-url", url, "--num-speculative-tokens", "2"],
         "--num-speculative-tokens needs --backend grpc"),
        (["--base-url", url, "--server", "x:1"], "--base-url is for --backend openai"),
        (["--backend", "openai", "--base-url", "ftp://x"], "--base-url must be http://"),
        (["--backend", "openai", "--base-url", url, "--wait-ready", "1"],
         f"server {url} lists no model after 1s (last answer: CONNECT_ERROR"),
    ]  # fmt: skip
    for flags, message in cases:
        assert main(["bench", "serve", "--no-progress", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("specserve bench: error: " + message), err
        assert "Traceback" not in "\n".join(err)
    with FakeOpenAI() as server:
        argv = ["bench", "serve", "--backend", "openai", "--base-url", server.url,
                "--tokenizer", "/nonexistent/tok", "--no-progress"]  # fmt: skip
        assert main(argv) == 2
        assert "need --tokenizer DIR_OR_HUB_ID" in capsys.readouterr().err
        assert main([*argv[:6], "--model-name", "other", "--dataset", "chat"]) == 2
        err = capsys.readouterr().err
        assert f"--model-name 'other' is not served by {server.url}; it serves ['{MODEL}']" in err


# ---- pieces --------------------------------------------------------------------------
def test_sse_decoder_joins_data_lines_and_skips_comments():
    body = (b': keep-alive\r\n\r\nevent: message\ndata: {"a":\ndata:1}\n\n'
            b"id: 3\ndata: [DONE]\n\ndata: cut off")  # fmt: skip
    for size in (1, 7, len(body)):  # events split anywhere across pieces
        decoder = SseDecoder()
        pieces = [body[i : i + size] for i in range(0, len(body), size)]
        assert [e for p in pieces for e in decoder.feed(p)] == ['{"a":\n1}', "[DONE]"]


def test_parse_chunk_reads_chat_completions_and_errors():
    chat = parse_chunk('{"choices":[{"delta":{"content":"hi"},"finish_reason":null}]}')
    assert chat == (True, "hi", None, None, None, None, None)
    done = parse_chunk('{"choices":[{"text":"","finish_reason":"stop"}],"usage":'
                       '{"prompt_tokens":5,"completion_tokens":9}}')  # fmt: skip
    assert done == (True, "", "stop", 5, 9, None, None)
    spec = parse_chunk(
        '{"choices":[],"usage":{"completion_tokens":9,"completion_tokens_details":'
        '{"accepted_prediction_tokens":5,"rejected_prediction_tokens":3}}}'
    )
    assert (spec.accepted_tokens, spec.draft_tokens) == (5, 8)
    assert parse_chunk('{"choices":[],"usage":{"completion_tokens":9}}').has_choice is False
    for bad in ('{"error": {"message": "x"}}', "not json", "[1]"):
        with pytest.raises(StreamError):
            parse_chunk(bad)


def test_split_and_base_url():
    assert _split(12, 4) == [3, 3, 3, 3] and _split(10, 4) == [3, 3, 2, 2]
    url = parse_base_url("https://gw.example/api/v1/")
    assert (url.scheme, url.host, url.port, url.prefix) == ("https", "gw.example", 443, "/api")
    assert parse_base_url("http://127.0.0.1:30000").authority == "127.0.0.1:30000"
