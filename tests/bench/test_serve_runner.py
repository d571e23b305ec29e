"""The load generator's arrival processes and request streams, with a fake client."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics

import grpc
import pytest

from engine.benchmarks import serve_workload as wl
from engine.benchmarks.serve_runner import GrpcTransport, LoadGenerator, LoadShape, RequestOptions
from engine.client import GenerateDelta, Usage


class FakeRpcError(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.RESOURCE_EXHAUSTED


class FakeClient:
    """Streams `num_tokens` one-token deltas, `step_s` apart; counts calls in flight."""

    def __init__(self, num_tokens: int = 3, step_s: float = 0.0, fail_every: int = 0):
        self.num_tokens, self.step_s, self.fail_every = num_tokens, step_s, fail_every
        self.in_flight = self.max_in_flight = self.num_calls = 0

    def generate(self, request=None, timeout=None):
        self.num_calls += 1
        return self._stream(self.num_calls)

    async def _stream(self, call: int):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.fail_every and call % self.fail_every == 0:
                raise FakeRpcError()
            for i in range(self.num_tokens):
                await asyncio.sleep(self.step_s)
                last = i == self.num_tokens - 1
                usage = Usage(7, self.num_tokens, 0, 4, 3, 0.0) if last else None
                yield GenerateDelta("r", "x", [i], [], "length" if last else None, usage)
        finally:
            self.in_flight -= 1


def synthetic(seed: int = 0):
    return wl.synthetic_requests(list(range(100)), wl.LengthDist(8), wl.LengthDist(4), seed)


def run(client, shape: LoadShape):
    generator = LoadGenerator(GrpcTransport([client], RequestOptions()))
    return asyncio.run(generator.run(synthetic(), shape))


def test_open_loop_mean_rate_for_fixed_seed():
    rate, n = 200.0, 300
    records, _ = run(FakeClient(), LoadShape(request_rate=rate, num_requests=n, seed=3))
    starts = sorted(r.start for r in records)
    measured = (n - 1) / (starts[-1] - starts[0])
    assert measured == pytest.approx(rate, rel=0.2)
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.3)


def test_closed_loop_keeps_exactly_n_in_flight():
    client = FakeClient(num_tokens=4, step_s=0.002)
    records, duration = run(client, LoadShape(concurrency=5, num_requests=40))
    assert client.max_in_flight == 5 and len(records) == 40
    assert [r.index for r in records] == list(range(40))
    r = records[0]
    assert r.ok and r.num_output_tokens == 4 and r.finish_reason == "length"
    assert (r.num_prompt_tokens, r.num_draft_tokens, r.num_accepted_tokens) == (7, 4, 3)
    assert r.ttft is not None and r.tpot is not None and duration > 0


def test_max_concurrency_caps_open_loop():
    client = FakeClient(num_tokens=3, step_s=0.01)
    shape = LoadShape(request_rate=1000.0, max_concurrency=3, num_requests=30)
    records, _ = run(client, shape)
    assert client.max_in_flight == 3 and all(r.ok for r in records)


def test_duration_bounds_the_run():
    """No request starts after duration_s; the run ends with the last one (what holds on
    a loaded machine too, where the last request may end well after duration_s)."""
    records, duration = run(FakeClient(step_s=0.005), LoadShape(concurrency=2, duration_s=0.2))
    assert 0 < len(records) < 200
    assert all(r.start < 0.2 for r in records)
    assert duration >= max(0.2, *(r.end for r in records))


def test_errors_are_recorded_by_status_code():
    records, _ = run(FakeClient(fail_every=4), LoadShape(concurrency=2, num_requests=12))
    assert sum(r.error == "RESOURCE_EXHAUSTED" for r in records) == 3
    assert all(not r.ok for r in records if r.error)


def test_load_shape_validation():
    for kwargs in ({"num_requests": 1}, {"concurrency": 1, "request_rate": 1.0,
                   "num_requests": 1}, {"concurrency": 0, "num_requests": 1},
                   {"concurrency": 1}):  # fmt: skip
        with pytest.raises(ValueError):
            LoadShape(**kwargs)


# ---- workloads -----------------------------------------------------------------------
def test_synthetic_requests_are_reproducible_and_in_range():
    dist_in, dist_out = wl.LengthDist(20, 0.5), wl.LengthDist(10, 0.2)
    corpus = list(range(50))

    def first_30(seed: int) -> list[wl.BenchRequest]:
        return list(itertools.islice(wl.synthetic_requests(corpus, dist_in, dist_out, seed), 30))

    a = first_30(1)
    assert a == first_30(1) and a != first_30(2)
    assert all(10 <= len(r.token_ids) == r.num_prompt_tokens <= 30 for r in a)
    assert all(8 <= r.max_tokens <= 12 for r in a)
    assert len({len(r.token_ids) for r in a}) > 3  # lengths vary
    assert all(r.token_ids[1] == (r.token_ids[0] + 1) % 50 for r in a)  # corpus windows


def test_length_dist_bounds_and_validation():
    assert wl.LengthDist(64).bounds == (64, 64)
    assert wl.LengthDist(100, 0.25).bounds == (75, 125)
    for args in ((0,), (10, 1.0), (10, -0.1)):
        with pytest.raises(ValueError):
            wl.LengthDist(*args)


def test_jsonl_and_sharegpt_loading(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a"}\n\n{"prompt": "b", "output_len": 5}\n')
    assert wl.load_jsonl(jsonl) == [wl.TextItem("a"), wl.TextItem("b", 5)]
    reqs = wl.text_requests(wl.load_jsonl(jsonl), wl.LengthDist(9), seed=0)
    assert {(r.text, r.max_tokens) for r in itertools.islice(reqs, 20)} == {("a", 9), ("b", 5)}

    convs = [
        {"id": "1", "conversations": [{"from": "human", "value": "hi there"},
                                      {"from": "gpt", "value": "hello"}]},
        {"id": "2", "conversations": [{"from": "gpt", "value": "x"}]},
        {"id": "3", "conversations": [{"from": "human", "value": "long"},
                                      {"from": "gpt", "value": "reply"},
                                      {"from": "human", "value": "more"}]},
    ]  # fmt: skip
    sharegpt = tmp_path / "s.json"
    sharegpt.write_text(json.dumps(convs))
    pairs = wl.load_sharegpt(sharegpt)
    assert pairs == [("hi there", "hello"), ("long", "reply")]
    items = wl.sharegpt_items(pairs, reply_lens=[6, 3], prompt_lens=[5, 9], max_len=64)
    assert items == [wl.TextItem("hi there", 6)]  # the second reply is too short
