"""`bench serve --dataset shared-prefix` and `--server A,B`: requests on a few long system
prompts, spread round-robin over several servers."""

from __future__ import annotations

import itertools
import json

from engine.benchmarks.serve_openai import OpenAIOptions
from engine.benchmarks.serve_runner import RequestOptions
from engine.benchmarks.serve_workload import LengthDist, shared_prefix_requests
from engine.config import EngineConfig
from engine.entrypoints.cli import main
from tests.server.helpers import InProcessServer


def _take(n: int, seed: int):
    return list(itertools.islice(shared_prefix_requests(3, 300, LengthDist(8), seed), n))


def test_a_few_long_system_prompts_the_same_for_every_seed():
    a, b = _take(60, seed=1), _take(60, seed=2)
    assert {r.system for r in a} == {r.system for r in b}
    assert len({r.system for r in a}) == 3 and all(len(r.system) == 300 for r in a)
    assert [r.system for r in a] != [r.system for r in b]  # the order follows the seed
    assert [r.system for r in a] == [r.system for r in _take(60, seed=1)]


def test_both_transports_send_the_system_prompt_first():
    req = _take(1, seed=0)[0]
    proto = RequestOptions().to_proto(req)
    assert [(m.role, m.content) for m in proto.chat.messages] == [
        ("system", req.system),
        ("user", req.text),
    ]
    assert RequestOptions(chat_template=False).to_proto(req).text == f"{req.system}\n\n{req.text}"
    path, body = OpenAIOptions(model="m").wire(req, req.text)
    assert path == "/v1/chat/completions"
    assert body["messages"] == [
        {"role": "system", "content": req.system},
        {"role": "user", "content": req.text},
    ]


def test_requests_spread_over_several_servers_and_hit_their_prefix_caches(tiny_model_dir, tmp_path):
    config = EngineConfig(model=tiny_model_dir, device="cpu", num_kv_blocks=256)
    with InProcessServer(config) as one, InProcessServer(config) as two:
        out = tmp_path / "run.json"
        argv = ["bench", "serve", "--server", f"{one.target},{two.target}", "--no-progress",
                "--dataset", "shared-prefix", "--num-prefixes", "2", "--prefix-chars", "200",
                "--output-len", "4", "--num-requests", "16", "--concurrency", "2",
                "--json", str(out)]  # fmt: skip
        assert main(argv) == 0
        summary = json.loads(out.read_text())["summary"]
        assert summary["num_completed"] == 16 and summary["num_errors"] == 0
        for server in (one, two):
            stats = server.engine.stats
            assert sum(stats.num_requests_finished.values()) >= 8  # round-robin, + warm-up
            assert stats.num_prefix_hit_tokens >= 5 * 160  # the shared system prompts
