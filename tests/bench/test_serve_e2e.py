"""`specserve bench serve` against a real server process with the tiny model."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from engine.entrypoints.cli import main

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def bench(bench_server, tmp_path, name: str, *flags: str) -> dict:
    out = tmp_path / f"{name}.json"
    argv = ["bench", "serve", "--server", bench_server.target, "--no-progress",
            "--input-len", "24", "--output-len", "8", "--json", str(out), *flags]  # fmt: skip
    assert main(argv) == 0
    return json.loads(out.read_text())


def assert_filled(value, path: str = "result") -> None:
    """No None, no NaN, no empty dict anywhere below `value`."""
    assert value is not None, path
    if isinstance(value, float):
        assert not math.isnan(value), path
    elif isinstance(value, dict):
        assert value, path
        for key, item in value.items():
            if key != "errors":  # an empty error table is the good outcome
                assert_filled(item, f"{path}.{key}")


def test_closed_loop_run_fills_every_field(bench_server, tmp_path, capsys):
    plot_dir = tmp_path / "plots"
    plot = ["--plot", str(plot_dir)] if HAS_MATPLOTLIB else []
    result = bench(bench_server, tmp_path, "run", "--concurrency", "4", "--num-requests", "16",
                   "--warmup", "2", "--range-ratio", "0.25", "--slo", "ttft=5000,tpot=1000",
                   *plot)  # fmt: skip
    s = result["summary"]
    assert_filled(s, "summary")
    assert_filled(result["server"], "server")
    assert s["num_requests"] == s["num_completed"] == 16 and s["num_errors"] == 0
    assert s["errors"] == {}
    assert s["num_output_tokens"] == sum(r["output_tokens"] for r in result["requests"])
    assert 16 * 6 <= s["num_output_tokens"] <= 16 * 10  # max_tokens 8 +-25%, EOS ignored
    assert s["goodput"] == pytest.approx(s["request_throughput"])
    assert s["num_draft_tokens"] > 0  # the server speculates (ngram) and reports it
    for r in result["requests"]:
        assert r["error"] is None and r["finish_reason"] == "length"
        for key in ("ttft_ms", "tpot_ms", "e2e_ms", "prompt_tokens", "output_tokens"):
            assert r[key] is not None and r[key] > 0, key
        assert r["ttft_ms"] <= r["e2e_ms"]
        assert r["tpot_ms"] == pytest.approx(
            (r["e2e_ms"] - r["ttft_ms"]) / (r["output_tokens"] - 1), abs=1e-2
        )
    assert "TTFT" in capsys.readouterr().out
    if HAS_MATPLOTLIB:
        assert {p.name for p in plot_dir.iterdir()} == {
            "latency_cdf.png",
            "throughput_over_time.png",
        }


def test_same_seed_same_request_sequence(bench_server, tmp_path):
    flags = ["--concurrency", "1", "--num-requests", "5", "--range-ratio", "0.5", "--seed", "9"]
    a = bench(bench_server, tmp_path, "a", *flags)
    b = bench(bench_server, tmp_path, "b", *flags)
    lengths = [(r["prompt_tokens"], r["output_tokens"]) for r in a["requests"]]
    assert lengths == [(r["prompt_tokens"], r["output_tokens"]) for r in b["requests"]]
    assert len(set(lengths)) > 1


def test_open_loop_chat_dataset_and_error_counts(bench_server, tmp_path):
    result = bench(
        bench_server,
        tmp_path,
        "open",
        "--dataset",
        "chat",
        "--request-rate",
        "50",
        "--burstiness",
        "0.5",
        "--max-concurrency",
        "4",
        "--num-requests",
        "10",
    )
    assert result["summary"]["num_errors"] == 0
    assert all(r["prompt_tokens"] > 0 for r in result["requests"])
    # 65 draft tokens per step is out of range: every request is refused, by status code.
    bad = bench(bench_server, tmp_path, "bad", "--num-requests", "3",
                "--num-speculative-tokens", "65")  # fmt: skip
    assert bad["summary"]["errors"] == {"INVALID_ARGUMENT": 3}


def test_sweep_rate_search_and_compare(bench_server, tmp_path, capsys):
    flags = ["--sweep", "1,2", "--num-requests", "6", "--slo", "ttft=5000,tpot=1000",
             "--rate-search-steps", "1"]  # fmt: skip
    spec = bench(bench_server, tmp_path, "spec", *flags, "--label", "spec")
    off = bench(bench_server, tmp_path, "off", *flags, "--label", "off",
                "--num-speculative-tokens", "0")  # fmt: skip
    assert [lv["concurrency"] for lv in spec["levels"]] == [1, 2]
    assert spec["knee_concurrency"] in (1, 2)
    for level in spec["levels"]:
        assert_filled(level["summary"], "level")
    search = spec["rate_search"]
    assert len(search["runs"]) == 1 and search["max_request_rate"] > 0  # a generous SLO
    assert off["levels"][0]["summary"]["num_draft_tokens"] == 0
    out = capsys.readouterr().out
    assert "knee" in out and "highest request rate meeting the SLO" in out

    plot = ["--plot", str(tmp_path / "cmp")] if HAS_MATPLOTLIB else []
    assert main(["bench", "serve", "--compare", str(tmp_path / "spec.json"),
                 str(tmp_path / "off.json"), *plot]) == 0  # fmt: skip
    table = capsys.readouterr().out
    assert "c=2 output tok/s" in table and "B/A" in table
    if HAS_MATPLOTLIB:
        assert (tmp_path / "cmp" / "sweep.png").stat().st_size > 0


def test_file_datasets(bench_server, tmp_path):
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "Tell me a story"}\n{"prompt": "Hi", "output_len": 3}\n')
    result = bench(bench_server, tmp_path, "jsonl", "--dataset", "jsonl", "--dataset-path",
                   str(jsonl), "--num-requests", "6", "--concurrency", "3")  # fmt: skip
    assert result["summary"]["num_errors"] == 0
    assert {r["output_tokens"] for r in result["requests"]} <= {3, 8}

    conversations = [
        {"conversations": [{"from": "human", "value": f"Question number {i}?"},
                           {"from": "gpt", "value": "An answer " * (i + 1)}]}
        for i in range(4)
    ]  # fmt: skip
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps(conversations))
    result = bench(bench_server, tmp_path, "sharegpt", "--dataset", "sharegpt",
                   "--dataset-path", str(sharegpt), "--num-requests", "6")  # fmt: skip
    assert result["summary"]["num_errors"] == 0
    # Output lengths come from the reference replies (byte tokenizer: one per character).
    assert {r["output_tokens"] for r in result["requests"]} <= {10, 20, 30, 40}


def test_no_server_is_one_line_after_the_wait(capsys):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["bench", "serve", "--server", f"127.0.0.1:{port}", "--wait-ready", "1",
            "--num-requests", "1", "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == f"waiting for 127.0.0.1:{port} to report SERVING..."
    assert err[-1].startswith(
        f"specserve bench: error: server 127.0.0.1:{port} not SERVING after 1s"
    )
    assert "(last health answer: UNAVAILABLE)" in err[-1]
    assert "Traceback" not in "\n".join(err)
