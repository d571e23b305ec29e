"""Decode throughput of our paged model vs transformers ``generate`` on the same weights.

    python -m engine.models.benchmark --batch-sizes 1 32 --new-tokens 64

Both run in this process, fp32, greedy, interleaved (ours, HF, ours, HF ...) and the best
round counts, so load from other processes on the machine hits both sides alike.
Decode tokens/s = batch * new tokens / (generation time - prefill time).
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.loader import load_model
from engine.models.simple_runner import SimplePagedRunner


def _time_ours(runner: SimplePagedRunner, prompts: list[list[int]], new_tokens: int) -> float:
    start = time.perf_counter()
    runner.generate_greedy(prompts, 1)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    runner.generate_greedy(prompts, new_tokens + 1)
    return len(prompts) * new_tokens / (time.perf_counter() - start - prefill)


def _time_hf(hf_model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    # Equal-length prompts: no padding, so HF does exactly the same work as we do.
    input_ids = torch.tensor(prompts)
    kwargs = dict(do_sample=False, pad_token_id=pad_id, attention_mask=torch.ones_like(input_ids))
    start = time.perf_counter()
    hf_model.generate(input_ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    hf_model.generate(
        input_ids, max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, **kwargs
    )
    return len(prompts) * new_tokens / (time.perf_counter() - start - prefill)


def run(model: str | None, batch_sizes: list[int], new_tokens: int, rounds: int) -> None:
    from transformers import AutoModelForCausalLM

    loaded = load_model(model, dtype="float32", device="cpu")
    hf_model = AutoModelForCausalLM.from_pretrained(loaded.model_dir, dtype=torch.float32)
    hf_model.eval()
    runner = SimplePagedRunner(loaded.model, num_blocks=64 * max(batch_sizes) + 1)
    prompt = loaded.tokenizer("The history of the city of Paris begins")["input_ids"]
    pad_id = next(iter(loaded.eos_token_ids), 0)
    print(f"threads={torch.get_num_threads()} prompt_len={len(prompt)} new_tokens={new_tokens}")
    for batch in batch_sizes:
        prompts = [list(prompt)] * batch
        ours, hf = 0.0, 0.0
        with torch.inference_mode():
            for _ in range(rounds):
                ours = max(ours, _time_ours(runner, prompts, new_tokens))
                hf = max(hf, _time_hf(hf_model, prompts, new_tokens, pad_id))
        print(f"batch {batch:3d}: ours {ours:8.1f} tok/s  hf {hf:8.1f} tok/s  x{ours / hf:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2-135M")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    run(args.model, args.batch_sizes, args.new_tokens, args.rounds)


if __name__ == "__main__":
    main()
