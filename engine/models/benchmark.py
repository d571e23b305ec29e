"""Decode throughput of our paged model vs transformers ``generate`` on the same weights.

    python -m engine.models.benchmark --batch-sizes 1 32 --new-tokens 64

Both run in this process, fp32, greedy, interleaved (ours, HF, ours, HF ...) and the best
round counts, so load from other processes on the machine hits both sides alike.
Decode tokens/s = batch * new tokens / decode time; for HF the decode time is
generate(new + 1 tokens) - generate(1 token), each the best of its rounds.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.loader import load_model
from engine.models.simple_runner import SimplePagedRunner


def _time_ours(runner: SimplePagedRunner, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for ``new_tokens`` batched decode steps after a (untimed) packed prefill."""
    seq_ids = list(range(len(prompts)))
    for seq_id in seq_ids:
        runner.add_sequence(seq_id)
    next_ids = runner.step(list(zip(seq_ids, prompts, strict=True))).argmax(-1).tolist()
    start = time.perf_counter()
    for _ in range(new_tokens):
        logits = runner.step([(s, [t]) for s, t in zip(seq_ids, next_ids, strict=True)])
        next_ids = logits.argmax(-1).tolist()
    elapsed = time.perf_counter() - start
    for seq_id in seq_ids:
        runner.free_sequence(seq_id)
    return elapsed


def _time_hf(hf_model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    """Seconds ``generate`` takes for ``new_tokens`` greedy tokens (prompts of equal length)."""
    input_ids = torch.tensor(prompts)  # equal lengths: no padding, the same work as ours
    start = time.perf_counter()
    hf_model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=pad_id,
    )
    return time.perf_counter() - start


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
        ours, hf_total, hf_prefill = [], [], []
        with torch.inference_mode():
            for _ in range(rounds):  # interleaved, best of each: load hits both sides alike
                ours.append(_time_ours(runner, prompts, new_tokens))
                hf_total.append(_time_hf(hf_model, prompts, new_tokens + 1, pad_id))
                hf_prefill.append(_time_hf(hf_model, prompts, 1, pad_id))
        ours_tps = batch * new_tokens / min(ours)
        hf_tps = batch * new_tokens / (min(hf_total) - min(hf_prefill))
        print(
            f"batch {batch:3d}: ours {ours_tps:8.1f} tok/s  hf generate {hf_tps:8.1f} tok/s"
            f"  x{ours_tps / hf_tps:.2f}"
        )


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
