"""End to end through the real Shepherd Model Gateway: two specserve worker processes on a
tiny chat model behind `smg launch --backend vllm --policy cache_aware`, spoken to over
plain HTTP the way OpenAI clients do.

The tests run in file order and share the workers and the gateway; the last one kills a
worker.
"""

from __future__ import annotations

import random
import urllib.request
from pathlib import Path

import pytest

from engine.client import SpecserveClient
from tests.gateway.gateway import Gateway
from tests.ops.scrape import parse, value
from tests.server.helpers import ServerProcess, wait_until

QUESTION = [{"role": "user", "content": "Hello there, who are you?"}]


@pytest.fixture(scope="module")
def workers(tiny_model_dir):
    procs = [ServerProcess(Path(tiny_model_dir), "--log-level", "WARNING") for _ in range(2)]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            with SpecserveClient(proc.target) as client:
                client.wait_serving(120)
        yield procs
    finally:
        for proc in procs:
            proc.kill()


@pytest.fixture(scope="module")
def gateway(workers, tiny_model_dir):
    # Health probes every second, so a killed worker is seen quickly.
    gw = Gateway([w.target for w in workers], tiny_model_dir, "--policy", "cache_aware",
                 "--health-check-interval-secs", "1")  # fmt: skip
    try:
        wait_until(lambda: gw.num_healthy_workers() == 2, 60, "the gateway to take both workers")
        yield gw
    finally:
        gw.stop()


def _grpc(worker: ServerProcess, prompt=None, **kw):
    """specserve's own answer (greedy) and prompt length, straight from a worker."""
    with SpecserveClient(worker.target) as client:
        reply = client.generate_complete(prompt, temperature=0.0, ignore_eos=True, **kw)
        if kw.get("messages") is not None:
            num_prompt_tokens = len(client.tokenize(messages=kw["messages"]))
        else:
            num_prompt_tokens = len(client.tokenize(prompt))
    return reply.text, num_prompt_tokens


def _scrape(worker: ServerProcess) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics") as r:
        return parse(r.read())


def _worker(workers: list[ServerProcess], routed_id: str) -> ServerProcess:
    (worker,) = [w for w in workers if routed_id == f"grpc://{w.target}"]
    return worker


def _body(gateway: Gateway, **kw) -> dict:
    return {"model": gateway.model, "temperature": 0.0, "ignore_eos": True, **kw}


def test_models_lists_the_served_model(gateway: Gateway, tiny_model_dir):
    (model,) = gateway.get("/v1/models")["data"]
    assert model["id"] == tiny_model_dir


def test_chat_completion_is_specserves_greedy_text(gateway: Gateway, workers):
    reply, _ = gateway.post_json("/v1/chat/completions", _body(gateway, messages=QUESTION,
                                                               max_tokens=12))  # fmt: skip
    text, num_prompt_tokens = _grpc(workers[0], messages=QUESTION, max_tokens=12)
    (choice,) = reply["choices"]
    assert choice["message"]["content"] == text and choice["finish_reason"] == "length"
    assert reply["usage"]["prompt_tokens"] == num_prompt_tokens
    assert reply["usage"]["completion_tokens"] == 12
    assert reply["usage"]["total_tokens"] == num_prompt_tokens + 12


def test_streamed_chat_completion_is_the_same_text(gateway: Gateway, workers):
    body = _body(gateway, messages=QUESTION, max_tokens=12)
    chunks = gateway.stream("/v1/chat/completions",
                            {**body, "stream_options": {"include_usage": True}})  # fmt: skip
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    text, num_prompt_tokens = _grpc(workers[0], messages=QUESTION, max_tokens=12)
    assert "".join(d.get("content") or "" for d in deltas) == text
    assert finish[-1] == "length"
    usage = chunks[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (num_prompt_tokens, 12)


@pytest.mark.parametrize("stream", [False, True])
def test_text_completion_is_specserves_text_prompt_output(gateway: Gateway, workers, stream):
    prompt = "The capital of France is"
    body = _body(gateway, prompt=prompt, max_tokens=10)
    text, num_prompt_tokens = _grpc(workers[0], prompt, max_tokens=10)
    if stream:
        chunks = gateway.stream("/v1/completions",
                                {**body, "stream_options": {"include_usage": True}})  # fmt: skip
        got = "".join(c["choices"][0].get("text") or "" for c in chunks if c["choices"])
        usage = chunks[-1]["usage"]
    else:
        reply, _ = gateway.post_json("/v1/completions", body)
        got, usage = reply["choices"][0]["text"], reply["usage"]
    assert got == text
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (num_prompt_tokens, 10)


def test_seeded_sampling_through_the_gateway_is_reproducible(gateway: Gateway):
    body = _body(gateway, messages=QUESTION, max_tokens=16, temperature=1.2, seed=7)
    texts = {gateway.post_json("/v1/chat/completions", body)[0]["choices"][0]["message"]
             ["content"] for _ in range(3)}  # fmt: skip
    assert len(texts) == 1


def test_a_client_that_hangs_up_aborts_the_worker_request(gateway: Gateway, workers):
    before = [value(_scrape(w), "specserve_requests_finished_total", finish_reason="abort")
              for w in workers]  # fmt: skip
    body = _body(gateway, messages=QUESTION, max_tokens=400)
    sock = gateway.open_stream("/v1/chat/completions", body)
    received = b""
    while received.count(b"data: ") < 3:  # the stream is running on a worker
        received += sock.recv(4096)
    sock.close()

    def aborted_and_freed() -> bool:
        after = [_scrape(w) for w in workers]
        aborts = [value(s, "specserve_requests_finished_total", finish_reason="abort")
                  for s in after]  # fmt: skip
        running = sum(value(s, "specserve_num_requests_running") for s in after)
        return sum(aborts) == sum(before) + 1 and running == 0

    wait_until(aborted_and_freed, 15, "the worker to abort the request")
    for worker in workers:
        with SpecserveClient(worker.target) as client:
            stats = client.server_stats()
            assert stats.target_pool.num_blocks_in_use == 0 and stats.num_in_flight == 0


def test_requests_sharing_a_long_prefix_land_on_the_worker_holding_it(gateway: Gateway, workers):
    rng = random.Random(3)
    prefixes = ["".join(rng.choice("abcdefgh ") for _ in range(240)) for _ in range(2)]
    order = [i % 2 for i in range(12)]
    rng.shuffle(order)
    hits_before = [value(_scrape(w), "specserve_prefix_cache_hits_total") for w in workers]
    routes: dict[int, set[str]] = {0: set(), 1: set()}
    for n, p in enumerate(order):
        messages = [{"role": "system", "content": prefixes[p]},
                    {"role": "user", "content": f"question {n}"}]  # fmt: skip
        _, routed = gateway.post_json("/v1/chat/completions",
                                      _body(gateway, messages=messages, max_tokens=2))  # fmt: skip
        routes[p].add(routed)
    assert all(len(r) == 1 for r in routes.values()), routes  # one worker per prefix
    hits = {
        f"grpc://{w.target}": value(_scrape(w), "specserve_prefix_cache_hits_total") - before
        for w, before in zip(workers, hits_before)
    }
    for p in (0, 1):
        (holder,) = routes[p]
        # 6 requests: the first computes the 240-token prefix, the other 5 reuse it
        # (whole 16-token blocks; the byte-level tokenizer gives one token per character)
        assert hits[holder] >= 5 * 224


def test_a_killed_worker_is_routed_around_and_taken_back(gateway: Gateway, workers, tiny_model_dir):
    """What the gateway does (smg 1.13): the dead worker's KV-event stream breaks at
    once, so the gateway vetoes it right away; a stream that was running on it ends with
    an SSE error event (it is not retried); new requests all go to the survivor (none
    fails or waits for a health probe); failed probes mark the worker NotReady; a worker
    started again at the same address is taken back after its probes pass."""
    sock = gateway.open_stream("/v1/chat/completions",
                               _body(gateway, messages=QUESTION, max_tokens=400))  # fmt: skip
    head = b""
    while head.count(b"data: ") < 2:
        head += sock.recv(4096)
    (routed,) = [line.split(b": ", 1)[1].decode() for line in head.split(b"\r\n")
                 if line.lower().startswith(b"x-smg-routed-worker-id")]  # fmt: skip
    victim = _worker(workers, routed)
    survivor = next(w for w in workers if w is not victim)
    victim.kill()
    tail = b""
    while not tail.endswith(b"0\r\n\r\n"):  # the end of the chunked body
        chunk = sock.recv(65536)
        assert chunk, "the gateway closed the stream without ending it"
        tail += chunk
    sock.close()
    assert b'"type":"stream_error"' in tail and b"data: [DONE]" in tail

    for n in range(8):
        messages = [{"role": "user", "content": f"{QUESTION[0]['content']} {n}"}]
        reply, routed = gateway.post_json(
            "/v1/chat/completions", _body(gateway, messages=messages, max_tokens=4)
        )
        assert routed == f"grpc://{survivor.target}"
        assert reply["usage"]["completion_tokens"] == 4
    wait_until(lambda: gateway.num_healthy_workers() == 1, 20, "the gateway to drop the worker")

    revived = ServerProcess(Path(tiny_model_dir), "--log-level", "WARNING", port=victim.port,
                            metrics_port=victim.metrics_port)  # fmt: skip
    workers[workers.index(victim)] = revived  # the fixture kills it at the end
    revived.start()
    with SpecserveClient(revived.target) as client:
        client.wait_serving(120)
    wait_until(lambda: gateway.num_healthy_workers() == 2, 30, "the gateway to take it back")
