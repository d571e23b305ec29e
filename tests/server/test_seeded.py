"""Through the server, a seeded request's output depends on its own fields only: the same
on every run, alone or in a crowd, whatever speculation the server or the request picks."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from engine.client import SpecserveClient
from tests.server.helpers import wait_no_blocks_in_use

PROMPT = "abcabcabcabc once more: abcabc"


def _seeded(client: SpecserveClient, **kw):
    out = client.generate_complete(
        PROMPT, max_tokens=40, temperature=1.5, seed=3, ignore_eos=True, timeout=60, **kw
    )
    return out.token_ids, out.text


def test_the_same_seeded_request_gives_the_same_output_every_time(server, client):
    first = _seeded(client)
    assert len(first[0]) == 40
    assert all(_seeded(client) == first for _ in range(3))
    assert _seeded(client, num_speculative_tokens=0) == first
    assert _seeded(client, num_speculative_tokens=3) == first
    with SpecserveClient(server.target) as other, ThreadPoolExecutor(8) as pool:
        crowd = [
            pool.submit(other.generate_complete, f"noise {i} " * 5, max_tokens=30,
                        temperature=t, ignore_eos=True, timeout=60)
            for i, t in enumerate([0.0, 1.0, 0.7, 1.3, 0.0, 1.0])
        ]  # fmt: skip
        seeded = [pool.submit(_seeded, client, num_speculative_tokens=k) for k in (None, 1, 0)]
        assert [f.result() for f in seeded] == [first] * 3
        assert all(len(f.result().token_ids) == 30 for f in crowd)
    wait_no_blocks_in_use(client)
