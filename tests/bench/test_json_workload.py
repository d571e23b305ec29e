"""The json workload (extraction: a JSON schema per request) in `bench offline` and
`bench serve`: each request carries its schema on both wires, answers are checked
against it, and the offline run compares like with like."""

from __future__ import annotations

import itertools
import json

import pytest

from engine.benchmarks.serve_openai import OpenAIOptions
from engine.benchmarks.serve_runner import RequestOptions
from engine.benchmarks.serve_stats import RequestRecord, summarize
from engine.benchmarks.serve_workload import LengthDist, builtin_items, text_requests
from engine.benchmarks.workloads import JSON_REQUESTS, valid_share
from engine.entrypoints.cli import main


def test_every_json_request_carries_its_schema_on_both_wires():
    requests = list(itertools.islice(text_requests(builtin_items("json"), LengthDist(64), 0), 8))
    schemas = {json.dumps(s) for _, s in JSON_REQUESTS}
    for req in requests:
        assert req.json_schema in schemas
        prompt = next(p for p, s in JSON_REQUESTS if json.dumps(s) == req.json_schema)
        assert req.text == prompt  # each prompt with its own schema
        proto = RequestOptions().to_proto(req)
        assert proto.sampling.structured_output.json_schema == req.json_schema
        path, body = OpenAIOptions(model="m").wire(req, req.text)
        assert path == "/v1/chat/completions"
        fmt = body["response_format"]
        assert fmt["type"] == "json_schema"
        assert fmt["json_schema"]["schema"] == json.loads(req.json_schema)
    plain = next(text_requests(builtin_items("chat"), LengthDist(8), 0))
    assert not RequestOptions().to_proto(plain).sampling.HasField("structured_output")
    assert "response_format" not in OpenAIOptions(model="m").wire(plain, plain.text)[1]


def test_the_summary_counts_answers_that_parse_and_validate():
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                         "required": ["n"]})  # fmt: skip
    records = []
    for i, parts in enumerate([['{"n": ', "3}"], ['{"n": "x"}'], ["{"], ['{"n": 1}']]):
        r = RequestRecord(i, 0.0, 5)
        r.first_token, r.end = 0.1, 0.2
        r.chunk_times, r.chunk_tokens = [0.1, 0.2], [1, 1]
        r.json_schema, r.text = schema, parts
        records.append(r)
    failed = RequestRecord(4, 0.0, 5)
    failed.json_schema, failed.error = schema, "UNAVAILABLE"  # not completed: not counted
    s = summarize([*records, failed], 1.0, {})
    assert s["valid_json"] == pytest.approx(2 / 4)
    assert "valid_json" not in summarize(records[:0], 1.0, {})
    assert valid_share(["[1]", "{}"], [{"type": "array"}, {"type": "array"}]) == 0.5


@pytest.mark.slow
def test_offline_json_workload_constrained_free_and_half_on_the_default_model(tmp_path, capsys):
    out = tmp_path / "json.json"
    argv = ["bench", "offline", "--workload", "json", "--num-prompts", "4",
            "--output-len", "192", "--concurrency", "2", "--spec-modes", "none,ngram",
            "--baselines", "none", "--no-progress", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    for mode in ("none", "ngram"):
        constrained = results[f"specserve (spec: {mode}, json schema)"]
        free = results[f"specserve (spec: {mode})"]
        half = results[f"specserve (spec: {mode}, half json schema)"]
        assert constrained["spec"]["valid_json"] == 1.0
        assert half["spec"]["valid_json"] == 1.0
        assert half["spec"]["free_tpot_ms"] > 0
        # the free run makes as many tokens as the constrained answers had, and the
        # half-and-half run the same again
        assert free["num_output_tokens"] == constrained["num_output_tokens"]
        assert half["num_output_tokens"] == constrained["num_output_tokens"]
        assert "valid_json" not in free["spec"]
    printed = capsys.readouterr()
    assert "answers that parse and validate 100%" in printed.out
    assert "schemas compiled" in printed.err
