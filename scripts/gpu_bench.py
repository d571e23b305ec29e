"""A short throughput run on a CUDA GPU: a random-weight model of Llama-3-8B's shape
(hidden 4096, 32 layers, 32 heads / 8 KV heads, MLP 14336; the vocabulary of the
tokenizer given), served by specserve against transformers on the same GPU, beside the
GPU's measured bounds (device-to-device copy GB/s, bf16 matrix-product TFLOP/s).

    python scripts/gpu_bench.py --tokenizer DIR [--layers 32] [--out DIR]

DIR holds tokenizer files (tokenizer.json, tokenizer_config.json, a chat template): the
lent device machine has no network, so the tokenizer travels with the working tree. The
model is built on the GPU (seconds), saved as bf16 safetensors under /dev/shm (or --work)
and loaded back through specserve's own loading code. Runs, each one `bench offline`
invocation with its baseline beside it:

  1. batch 1: 8 chat prompts x 64 tokens one at a time, no speculation and n-gram,
     against transformers generate();
  2. 32 x 64 all at once, against transformers generate_batch() (continuous batching).

Prints each run's table, then tok/s against the read bound (weights bytes per step at
the measured copy bandwidth) for batch 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def measure_bounds() -> dict:
    """Copy bandwidth (bytes read per second: a copy reads n and writes n) and the bf16
    8192^3 matrix product rate, each the best of several timed repetitions."""
    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(8):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    read_gbs = n / best / 1e9
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    best = float("inf")
    for _ in range(3):
        a @ b
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return {"read_gbs": read_gbs, "bf16_tflops": 2 * 8192**3 / best / 1e12}


def build_model(tokenizer_dir: Path, out_dir: Path, layers: int) -> int:
    """Random bf16 weights in Llama-3-8B's shape, saved with the tokenizer; returns the
    bytes of the weights read per decode step (every parameter but the embedding)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    # Small weights so the random model's activations stay finite through 32 layers.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    total = sum(p.numel() for p in model.parameters()) * 2
    embed = model.model.embed_tokens.weight.numel() * 2
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    del model
    torch.cuda.empty_cache()
    return total - embed


def bench(model_dir: Path, json_path: Path, extra: list[str]) -> dict:
    cmd = [
        sys.executable, "-m", "engine", "bench", "offline", "--no-progress",
        "--model", str(model_dir), "--device", "cuda", "--dtype", "bfloat16",
        "--kv-cache-memory-gib", "16", "--json", str(json_path), *extra,
    ]  # fmt: skip
    print("$ " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    print(f"({time.perf_counter() - start:.0f} s)", flush=True)
    with open(json_path) as f:
        return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, type=Path)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--work", type=Path, default=None, help="where the model is saved")
    parser.add_argument("--out", type=Path, default=None, help="copy the JSON results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_bench: torch sees no CUDA device")
    print(f"gpu_bench: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    bounds = measure_bounds()
    print(
        f"bounds: copy {bounds['read_gbs']:.0f} GB/s read (and as much written), "
        f"bf16 matrix product {bounds['bf16_tflops']:.0f} TFLOP/s",
        flush=True,
    )
    base = args.work or (Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    work = Path(tempfile.mkdtemp(prefix="specserve-gpu-", dir=base))
    try:
        start = time.perf_counter()
        step_bytes = build_model(args.tokenizer, work, args.layers)
        print(
            f"model: Llama-3-8B shape, {args.layers} layers, {step_bytes / 1e9:.2f} GB of "
            f"weights read per step, built and saved in {time.perf_counter() - start:.0f} s",
            flush=True,
        )
        batch1 = "--num-prompts 8 --output-len 64 --concurrency 1 --spec-modes none,ngram"
        batch32 = "--num-prompts 32 --output-len 64 --spec-modes none"
        runs = {
            "batch1": bench(work, work / "b1.json", [*batch1.split(), "--baselines", "generate"]),
            "batch32": bench(
                work, work / "b32.json", [*batch32.split(), "--baselines", "generate_batch"]
            ),
        }
        bound_tok_s = bounds["read_gbs"] * 1e9 / step_bytes
        for result in runs["batch1"]["results"]:
            tok_s = result["output_tokens_per_s"]
            print(
                f"batch 1 {result['system']}: {tok_s:.1f} tok/s = "
                f"{100 * tok_s / bound_tok_s:.0f}% of the read bound ({bound_tok_s:.0f} tok/s)"
            )
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            with open(args.out / "gpu_bench.json", "w") as f:
                json.dump({"bounds": bounds, "step_bytes": step_bytes, "runs": runs}, f, indent=2)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
