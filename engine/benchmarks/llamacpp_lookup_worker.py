"""llama.cpp's own prompt lookup decoding as a `bench offline` baseline: its
`llama-lookup` example, run in llama.cpp's virtualenv.

    <llamacpp venv>/bin/python llamacpp_lookup_worker.py < request.json

Standalone: imports llama_cpp (only to turn the token ids back into the text the binary
reads) and the protocol file beside it, never specserve. `llama-lookup` is found beside
the interpreter (scripts/install_baselines.sh builds it there, its libraries in the
venv's lib/). One process per prompt, greedy, EOS ignored, drafts of up to
SPECSERVE_LOOKUP_DRAFT tokens (default 4, specserve's k); each request's time is what
the binary reports for encoding the prompt and decoding, without loading the model.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from external_protocol import WorkerError, check_counts, emit_result, serve

_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")


def main() -> int:
    return serve("llama_cpp", _run, check=_one_at_a_time)


def _one_at_a_time(request: dict) -> None:
    if request["concurrency"] != 1:
        raise WorkerError("bad_request", "llama-lookup runs one request at a time")


def _binary() -> Path:
    found = Path(sys.executable).parent / "llama-lookup"
    if not found.is_file():
        raise WorkerError(
            "failed", f"no {found}: build it with scripts/install_baselines.sh llamacpp"
        )
    return found


def _run(llama_cpp, request: dict) -> int:
    binary = _binary()
    vocab = llama_cpp.Llama(model_path=request["model"], vocab_only=True, verbose=False)
    draft = int(os.environ.get("SPECSERVE_LOOKUP_DRAFT", "4"))
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent.parent / "lib")}
    requests, total = [], 0.0
    with tempfile.TemporaryDirectory(prefix="specserve-lookup-") as tmp:
        for i, ids in enumerate(request["prompts"]):
            prompt = Path(tmp) / f"{i}.txt"
            prompt.write_bytes(vocab.detokenize(ids, special=True))
            cmd = [str(binary), "-m", request["model"], "-f", str(prompt)]
            cmd += ["-n", str(request["output_len"]), "--spec-draft-n-max", str(draft)]
            cmd += ["--temp", "0", "--ignore-eos", "-t", str(request["num_threads"])]
            cmd += ["--load-mode", "none"]  # the weights read at load, not faulted in later
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            encoded, decoded = _ENCODED.search(proc.stderr), _DECODED.search(proc.stderr)
            if proc.returncode != 0 or encoded is None or decoded is None:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise WorkerError("failed", f"llama-lookup exited {proc.returncode}: {tail}")
            encode_s, decode_s = float(encoded.group(2)), float(decoded.group(2))
            requests.append(
                {
                    "ttft_s": encode_s,
                    "latency_s": encode_s + decode_s,
                    "num_tokens": request["output_len"],
                }
            )
            total += encode_s + decode_s
            print(f"llama-lookup: request {i + 1} done", file=sys.stderr, flush=True)
    check_counts(requests, request["output_len"], "llama-lookup")
    emit_result("llama.cpp lookup", llama_cpp.__version__, False, total, requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
