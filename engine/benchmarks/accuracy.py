"""`specserve bench accuracy`: what quantized weights (and a bf16 KV cache) cost in
accuracy.

Every variant (a dtype and a ``--quantization``, and with ``:bf16kv`` a bf16 KV cache
under the float32 model: ``--kv-cache-dtype bfloat16``) reads the same token sequences in one
prefill each, beside the reference, the model dequantized in float32:

- perplexity on held-out text (docstrings of standard-library functions, in
  engine/benchmarks/data/accuracy_passages.json: no module docstring, which is what
  train-draft's built-in prompts quote);
- the mean KL divergence of each next-token distribution from the reference's, and the
  largest logit difference, over the same text;
- top-1 agreement: the reference answers chat prompts greedily for --greedy-tokens
  tokens, each variant reads prompt + answer, and the table gives the share of answer
  positions where its argmax is the reference's token.

With --llamacpp-python, llama.cpp (in its own virtualenv) reads the same sequences from
the same .gguf, and its logits are compared with the GGUF served as stored, fp32.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

PASSAGES = Path(__file__).with_name("data") / "accuracy_passages.json"
DEFAULT_VARIANTS = (
    "float32:none,bfloat16:none,float32:auto,bfloat16:auto,bfloat16:int8,"
    "float32:none:bf16kv,float32:auto:bf16kv"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a .gguf, HF directory or hub id")
    parser.add_argument(
        "--variants",
        default=DEFAULT_VARIANTS,
        help="comma list of DTYPE:QUANTIZATION[:bf16kv] against float32:none (bf16kv: "
        "a bf16 KV cache, --kv-cache-dtype bfloat16)",
    )
    parser.add_argument("--num-passages", type=int, default=52, help="held-out passages read")
    parser.add_argument("--max-tokens", type=int, default=384, help="tokens read per passage")
    parser.add_argument("--num-chat-prompts", type=int, default=8, help="for top-1 agreement")
    parser.add_argument("--greedy-tokens", type=int, default=128, help="reference answer length")
    parser.add_argument(
        "--llamacpp-python",
        default=None,
        help="python of a venv with llama_cpp: compare its logits on the same .gguf",
    )
    parser.add_argument("--json", default=None, help="write the results to this JSON file")


@dataclass
class _Scores:
    """Running sums for one variant."""

    nll: float = 0.0
    kl: float = 0.0
    max_logit_diff: float = 0.0
    positions: int = 0
    agree: int = 0
    answered: int = 0
    extra: dict = field(default_factory=dict)

    def add_text(self, logits: torch.Tensor, ref: torch.Tensor, ids: list[int]) -> None:
        logp = torch.log_softmax(logits[:-1], -1)  # [n - 1, vocab]: predicts ids[1:]
        target = torch.tensor(ids[1:])
        self.nll -= float(logp.gather(1, target[:, None]).sum())
        ref_logp = torch.log_softmax(ref[:-1], -1)
        self.kl += float((ref_logp.exp() * (ref_logp - logp)).sum())
        self.max_logit_diff = max(self.max_logit_diff, float((logits - ref).abs().max()))
        self.positions += len(ids) - 1

    def row(self, name: str) -> dict:
        return {
            "variant": name,
            "perplexity": math.exp(self.nll / max(self.positions, 1)),
            "mean_kl": self.kl / max(self.positions, 1),
            "max_logit_diff": self.max_logit_diff,
            "top1_agreement": self.agree / max(self.answered, 1),
            **self.extra,
        }


def run(args: argparse.Namespace) -> int:
    from engine.loader import load_model

    variants = _parse_variants(args.variants)
    model_name = args.model or "the default model"
    _log(f"loading the reference and {len(variants)} variants of {model_name}...")
    ref = load_model(args.model, dtype="float32", device="cpu", quantization="none")
    models = {
        name: load_model(args.model, dtype=d, device="cpu", quantization=q)
        for name, (d, q, _) in variants.items()
    }
    kv = {name: kv_dtype for name, (_, _, kv_dtype) in variants.items()}
    texts = _passages(ref.tokenizer, args.num_passages, args.max_tokens)
    scores = {name: _Scores() for name in models}
    for i, ids in enumerate(texts):
        expected = _logits(ref.model, ids)
        for name, loaded in models.items():
            scores[name].add_text(_logits(loaded.model, ids, kv[name]), expected, ids)
        _log(f"passage {i + 1}/{len(texts)}")
    for prompt, answer in _greedy_answers(ref, args.num_chat_prompts, args.greedy_tokens):
        for name, loaded in models.items():
            logits = _logits(loaded.model, prompt + answer, kv[name])
            predicted = logits[len(prompt) - 1 : -1].argmax(-1)
            scores[name].agree += int((predicted == torch.tensor(answer)).sum())
            scores[name].answered += len(answer)
    rows = [scores[name].row(name) for name in models]
    if args.llamacpp_python:
        rows.append(_llamacpp_row(args, ref, models, texts))
    _print(rows, len(texts), sum(len(t) - 1 for t in texts))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def _parse_variants(spec: str) -> dict[str, tuple[str, str, torch.dtype | None]]:
    """name -> (dtype, quantization, the KV cache's dtype or None for the model's)."""
    from engine.config import DTYPES, QUANTIZATIONS

    variants = {}
    for item in spec.split(","):
        dtype, _, rest = item.strip().partition(":")
        quantization, _, kv = rest.partition(":")
        if (
            dtype not in DTYPES[1:]
            or quantization not in QUANTIZATIONS
            or kv not in ("", "bf16kv")
            or (kv and dtype != "float32")
        ):
            raise ValueError(
                f"--variants: {item!r} must be DTYPE:QUANTIZATION[:bf16kv] with DTYPE one of "
                f"{', '.join(DTYPES[1:])} and QUANTIZATION one of {', '.join(QUANTIZATIONS)} "
                "(bf16kv: float32 only)"
            )
        variants[item.strip()] = (dtype, quantization, torch.bfloat16 if kv else None)
    return variants


def _passages(tokenizer, num: int, max_tokens: int) -> list[list[int]]:
    passages = json.loads(PASSAGES.read_text())["passages"][:num]
    return [tokenizer.encode(p["text"])[:max_tokens] for p in passages]


@torch.inference_mode()
def _logits(model, ids: list[int], kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[len(ids), vocab] float32: one prefill of ``ids`` in fresh KV caches (of
    ``kv_dtype``, default the model's)."""
    from engine.attention import (
        allocate_kv_caches,
        build_attention_metadata,
        set_attention_metadata,
    )

    block_size = 16
    num_blocks = -(-len(ids) // block_size) + 1
    cfg = model.config
    dtype = kv_dtype or model.model.norm.weight.dtype
    caches = allocate_kv_caches(
        cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, "cpu"
    )
    model.bind_kv_caches(caches)
    table = list(range(1, num_blocks))
    metadata = build_attention_metadata([len(ids)], [len(ids)], [table], block_size, "cpu")
    with set_attention_metadata(metadata):
        hidden = model(torch.tensor(ids), torch.arange(len(ids)))
    return model.compute_logits(hidden).float()


def _greedy_answers(ref, num_prompts: int, num_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the reference's greedy answer ids) per chat prompt, EOS ignored."""
    from engine.benchmarks.offline import tokenize_prompts
    from engine.benchmarks.workloads import CHAT_PROMPTS
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.io.sampling_params import SamplingParams

    config = EngineConfig(speculative_method="none", dtype="float32", quantization="none")
    engine = LLMEngine(config, loaded=ref)
    prompts = tokenize_prompts(ref.tokenizer, CHAT_PROMPTS[:num_prompts], chat=True)
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    answers: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            answers.setdefault(out.request_id, []).extend(out.token_ids)
    return [(prompt, answers[str(i)]) for i, prompt in enumerate(prompts)]


def _llamacpp_row(args, ref, models, texts) -> dict:
    """llama.cpp's logits on the .gguf against ours served as stored (float32)."""
    if ref.gguf_path is None:
        raise ValueError(
            "--llamacpp-python compares a .gguf: pass the default model or --model FILE.gguf"
        )
    ours = models.get("float32:auto")
    if ours is None or ours.quantization != "gguf":
        raise ValueError("--llamacpp-python compares against float32:auto: keep it in --variants")
    worker = Path(__file__).with_name("llamacpp_logits.py")
    scores = _Scores()
    vs_reference = _Scores()
    with tempfile.TemporaryDirectory(prefix="specserve-llamacpp-") as out:
        request = {"model": str(ref.gguf_path), "sequences": texts, "out_dir": out}
        _log("llama.cpp: reading the same passages...")
        proc = subprocess.run(
            [args.llamacpp_python, str(worker)], input=json.dumps(request), text=True,
            capture_output=True,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"llama.cpp logits worker failed: {proc.stderr.strip()[-300:]}")
        import numpy as np

        for i, ids in enumerate(texts):
            theirs = torch.from_numpy(np.load(Path(out) / f"{i}.npy").astype(np.float32))
            scores.add_text(_logits(ours.model, ids), theirs, ids)
            vs_reference.add_text(theirs, _logits(ref.model, ids), ids)
    row = vs_reference.row("llama.cpp (same .gguf)")
    row.update(
        {
            "top1_agreement": None,
            "kl_vs_ours": scores.kl / max(scores.positions, 1),
            "max_logit_diff_vs_ours": scores.max_logit_diff,
        }
    )
    return row


def _print(rows: list[dict], num_texts: int, num_positions: int) -> None:
    print(
        f"\n{num_texts} passages, {num_positions} predicted tokens; reference: float32, "
        "dequantized (--quantization none)\n"
    )
    print("| variant | perplexity | mean KL vs reference | max abs logit diff | top-1 agreement |")
    print("|---|---|---|---|---|")
    for row in rows:
        agreement = "-" if row["top1_agreement"] is None else f"{row['top1_agreement']:.3f}"
        print(
            f"| {row['variant']} | {row['perplexity']:.3f} | {row['mean_kl']:.5f} | "
            f"{row['max_logit_diff']:.3f} | {agreement} |"
        )
    for row in rows:
        if "kl_vs_ours" in row:
            print(
                f"\nllama.cpp against specserve float32:auto on the same .gguf: mean KL "
                f"{row['kl_vs_ours']:.5f}, max abs logit diff {row['max_logit_diff_vs_ours']:.3f}"
            )


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
