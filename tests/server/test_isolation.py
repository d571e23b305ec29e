"""A client's request id is a label: reusing it, even concurrently, never mixes streams."""

from __future__ import annotations

import threading

import grpc

from engine.client import SpecserveClient
from tests.server.helpers import wait_no_blocks_in_use

PROMPT_A = [5, 6, 7, 8, 9, 10]
PROMPT_B = [40, 41, 42]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_reusing_a_cancelled_streams_id_never_receives_its_tokens(client: SpecserveClient):
    """The adversary's sequence: A (id "x") is cancelled after two tokens and B reuses
    "x" at once. B must get exactly its own greedy completion, every time."""
    alone = client.generate_complete(PROMPT_B, max_tokens=3, **GREEDY)
    for trial in range(20):
        stream_a = client.generate(PROMPT_A, request_id="x", max_tokens=400, **GREEDY)
        received = 0
        for delta in stream_a:
            received += len(delta.token_ids)
            if received >= 2:
                break
        stream_a.cancel()
        if trial % 2:
            deltas = list(client.generate(PROMPT_B, request_id="x", max_tokens=3, **GREEDY))
            assert {d.request_id for d in deltas} == {"x"}
            token_ids = [t for d in deltas for t in d.token_ids]
            text = "".join(d.text for d in deltas)
            last = deltas[-1]
        else:
            last = client.generate_complete(PROMPT_B, request_id="x", max_tokens=3, **GREEDY)
            assert last.request_id == "x"
            token_ids, text = last.token_ids, last.text
        assert (token_ids, text) == (alone.token_ids, alone.text), f"trial {trial}"
        assert last.usage.prompt_tokens == len(PROMPT_B)
        assert last.usage.completion_tokens == 3 and last.finish_reason == "length"
    wait_no_blocks_in_use(client)


def test_concurrent_streams_with_one_id_both_complete(client: SpecserveClient):
    alone = [
        client.generate_complete(prompt, max_tokens=n, **GREEDY)
        for prompt, n in ((PROMPT_A, 200), (PROMPT_B, 150))
    ]
    results: dict[int, object] = {}
    errors: list[grpc.RpcError] = []

    def run(i: int, prompt: list[int], n: int) -> None:
        try:
            results[i] = list(client.generate(prompt, request_id="same", max_tokens=n, **GREEDY))
        except grpc.RpcError as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(i, prompt, n))
        for i, (prompt, n) in enumerate(((PROMPT_A, 200), (PROMPT_B, 150)))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, [e.details() for e in errors]
    for i, expected in enumerate(alone):
        deltas = results[i]
        assert {d.request_id for d in deltas} == {"same"}
        assert [t for d in deltas for t in d.token_ids] == expected.token_ids
        assert deltas[-1].usage.prompt_tokens == expected.usage.prompt_tokens
    wait_no_blocks_in_use(client)
