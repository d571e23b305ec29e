"""`specserve train-draft --out DIR`: train a draft model for a target on this machine.

1. The target answers a prompt set through this engine (self-distillation; nothing is
   downloaded). Answers land in DIR/data in shards; a rerun keeps finished shards.
2. A shallow copy of the target (its embedding and head rows, L of its layers) learns
   to predict those answers; DIR/checkpoint.pt is written as it goes and a rerun resumes.
3. DIR gets the draft (config.json, model.safetensors, draft.json with the command that
   made it); `specserve serve --model TARGET --draft-model DIR` serves it. --export
   writes those three files alone to another directory.

A rerun resumes only what was made with the same settings (data/manifest.json, the
checkpoint's record) and refuses the rest in one line naming each flag that differs;
--restart trains again from scratch, keeping the answers when they were made with the
same data settings (they are what generating them again would give).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from engine.io.sampling_params import check_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", required=True, help="directory for the data, checkpoints and draft"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="the target: HF dir, .gguf, hub id (default: the default model)",
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory for --model")
    g = parser.add_argument_group("data (self-distillation)")
    g.add_argument(
        "--prompts",
        default=None,
        help="prompt file (one per line, or JSONL with a 'prompt' field) instead of the "
        "built-in set",
    )
    g.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="use this many prompts of the set (default: all of them)",
    )
    g.add_argument("--max-tokens", type=int, default=256, help="longest answer per prompt")
    g.add_argument("--max-num-seqs", type=int, default=64, help="answers generated at once")
    g.add_argument("--dtype", default="auto", help="the target's dtype while it answers")
    g = parser.add_argument_group("draft and training")
    g.add_argument("--num-layers", type=int, default=2, help="decoder layers in the draft")
    g.add_argument("--draft-vocab", type=int, default=8192, help="tokens the draft's head scores")
    g.add_argument("--epochs", type=int, default=6, help="passes over the data")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW, cosine)")
    g.add_argument(
        "--tokens-per-batch", type=int, default=4096, help="padded tokens per training step"
    )
    g.add_argument(
        "--train-dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="bfloat16 autocast in training; auto: where the CPU has native bf16",
    )
    g.add_argument("--seed", type=int, default=0, help="the same seed makes the same draft")
    g.add_argument(
        "--restart",
        action="store_true",
        help="train again from scratch: discard DIR's checkpoint (a rerun resumes it, and "
        "refuses one made with other settings); DIR/data is kept when it was made with the "
        "same --model, --prompts, --num-prompts, --max-tokens, --dtype and --seed, else "
        "discarded and generated again",
    )
    parser.add_argument(
        "--export",
        metavar="DIR",
        default=None,
        help="also write the servable draft alone (draft.json, config.json, "
        "model.safetensors) to DIR; --out keeps data/ and checkpoint.pt (~6x the draft)",
    )


def run(args: argparse.Namespace) -> int:
    from engine.train_draft.train import CHECKPOINT, check_checkpoint, checkpoint_record

    _check_args(args)
    out = Path(args.out).expanduser()
    if args.restart:
        (out / CHECKPOINT).unlink(missing_ok=True)  # the data waits for its manifest
    else:  # before the target loads: the settings known from the flags alone
        check_checkpoint(out, checkpoint_record(_settings(args)))
    out.mkdir(parents=True, exist_ok=True)
    prompts = _prompts(args)
    started = time.perf_counter()
    target_dir, manifest, target_vocab, eos_ids, data = _make_data(args, out, prompts)
    from engine.train_draft.data import load_sequences

    sequences = load_sequences(out / "data")
    target = (Path(target_dir), manifest, target_vocab, eos_ids)
    return _train_and_export(args, out, target, sequences, data, started)


def _check_args(args: argparse.Namespace) -> None:
    if args.num_prompts is not None:
        check_int("--num-prompts", args.num_prompts, 1, None)
    check_int("--max-tokens", args.max_tokens, 1, 8192)
    check_int("--max-num-seqs", args.max_num_seqs, 1, 4096)
    check_int("--num-layers", args.num_layers, 1, 64)
    check_int("--draft-vocab", args.draft_vocab, 2, None)
    check_int("--epochs", args.epochs, 1, 1000)
    check_int("--tokens-per-batch", args.tokens_per_batch, 64, None)
    check_int("--seed", args.seed, 0, 2**31 - 1)
    if not 0 < args.lr <= 1:
        raise ValueError(f"--lr must be in (0, 1], got {args.lr}")
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {args.out}: exists and is not a directory")
    if args.export is not None:
        _check_export(args.export, out)


def _check_export(export: str, out: Path) -> None:
    path = Path(export).expanduser()
    if path.resolve() == out.resolve():
        raise ValueError(f"--export must be a directory other than --out, got {export}")
    if path.exists() and not path.is_dir():
        raise ValueError(f"--export {export}: exists and is not a directory")
    if (path / "data").exists() or (path / "checkpoint.pt").exists():
        # another run's --out: exporting there would overwrite its draft
        raise ValueError(
            f"--export {export}: holds a train-draft work directory (data/, checkpoint.pt); "
            "export to a directory of its own"
        )


def _prompts(args: argparse.Namespace) -> list[str]:
    from engine.train_draft.prompts import builtin_prompt_count, builtin_prompts, load_prompt_file

    if args.prompts:
        prompts = load_prompt_file(args.prompts)
        return prompts[: args.num_prompts] if args.num_prompts else prompts
    return builtin_prompts(args.num_prompts or builtin_prompt_count(), seed=0)


def _make_data(args, out: Path, prompts: list[str]):
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.spec_decode.trained_draft import embed_probe_ids
    from engine.train_draft.data import (
        check_manifest,
        discard_other_data,
        embedding_fingerprint,
        generate_data,
        manifest_for,
    )
    from engine.train_draft.model import layer_sources

    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            tokenizer=args.tokenizer,
            speculative_method="none",
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs,
            seed=args.seed,
        )
    )
    loaded = engine.loaded
    layer_sources(loaded.arch.num_layers, args.num_layers)  # refuse before generating
    if loaded.float_weights_dir() is None:
        raise ValueError(f"{loaded.name}: the target's weights have no local directory")
    dtype = str(loaded.dtype).removeprefix("torch.")
    probe_ids = embed_probe_ids(loaded.arch.vocab_size)
    fingerprint = embedding_fingerprint(loaded.model.embedding_rows(probe_ids))
    manifest = manifest_for(loaded.name, prompts, args.max_tokens, args.seed, dtype, fingerprint)
    if args.restart:
        changes = discard_other_data(out / "data", manifest)
        if changes:
            _log(f"--restart: generating the data again ({'; '.join(changes)})")
    check_manifest(out / "data", manifest)  # before the progress bar: one line if refused
    bar = _bar(len(prompts), "answering", "prompt")
    tokens = [0]

    def progress(num_prompts: int, num_tokens: int) -> None:
        tokens[0] += num_tokens
        bar.update(num_prompts)
        bar.set_postfix_str(f"{tokens[0]} tokens", refresh=False)

    try:
        summary = generate_data(
            engine, prompts, out / "data", manifest, progress, max_in_flight=args.max_num_seqs
        )
    finally:
        bar.close()
    _log(
        f"data: {summary.num_sequences} answers, {summary.num_response_tokens} response tokens"
        + (f", generated in {summary.seconds:.0f} s" if summary.seconds else " (all resumed)")
    )
    target_dir = loaded.float_weights_dir()  # the draft starts from the target's layers
    return target_dir, manifest, loaded.arch.vocab_size, set(loaded.eos_token_ids), summary


def _settings(args):
    from engine.loader import cpu_has_native_bf16
    from engine.train_draft.train import TrainSettings

    if args.train_dtype == "auto":
        bf16 = cpu_has_native_bf16()
    else:
        bf16 = args.train_dtype == "bfloat16"
    return TrainSettings(
        num_layers=args.num_layers,
        vocab_size=args.draft_vocab,
        epochs=args.epochs,
        lr=args.lr,
        tokens_per_batch=args.tokens_per_batch,
        seed=args.seed,
        bf16=bf16,
    )


def _train_and_export(args, out, target, sequences, data, started):
    target_dir, manifest, target_vocab, eos_ids = target
    import torch

    from engine.train_draft.data import MANIFEST_FLAGS
    from engine.train_draft.model import DraftLM, choose_vocab
    from engine.train_draft.train import check_checkpoint, checkpoint_record, export, train

    settings = _settings(args)
    torch.manual_seed(args.seed)
    vocab = choose_vocab(sequences, target_vocab, min(args.draft_vocab, target_vocab), eos_ids)
    model = DraftLM(target_dir, args.num_layers, vocab)
    # the target and its answers: the checkpoint was trained from and on them too
    made_with = {MANIFEST_FLAGS.get(k, k): v for k, v in manifest.items()}
    check_checkpoint(out, checkpoint_record(settings, made_with))  # before the bar: one line
    bar = _bar(None, "training", "step")

    def progress(step: int, total: int, loss: float) -> None:
        bar.total = total
        bar.n = step
        bar.set_postfix_str(f"loss {loss:.3f}", refresh=False)
        bar.refresh()

    try:
        result = train(model, sequences, out, settings, progress, made_with)
    finally:
        bar.close()
    summary = {
        "command": shlex.join(getattr(args, "argv", ["specserve", "train-draft"])),
        "data": {
            "answers": data.num_sequences,
            "response_tokens": data.num_response_tokens,
            "generation_seconds": round(data.seconds, 1),
        },
        "training": {
            "steps": result.steps,
            "seconds": round(result.seconds, 1),
            "heldout_top1_by_epoch": [round(x, 4) for x in result.heldout_top1_by_epoch],
        },
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
    }
    export(model, out, manifest["target"], settings, summary)
    if args.export is not None:
        exported = Path(args.export).expanduser()
        exported.mkdir(parents=True, exist_ok=True)
        export(model, exported, manifest["target"], settings, summary)
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    _log(
        f"draft: {args.num_layers} layers, {len(vocab)}-token head, {size_mb:.1f} MB; held-out "
        f"top-1 agreement with the target {result.heldout_top1:.3f}; "
        f"{time.perf_counter() - started:.0f} s in all"
    )
    print(f"serve it with: {serve_hint(args)}")
    return 0


def serve_hint(args: argparse.Namespace) -> str:
    """The command that serves the draft, for the target as the user named it (none:
    the default model, serve's default too), quoted for the shell."""
    command = ["specserve", "serve"]
    if args.model is not None:
        command += ["--model", args.model]
    if args.tokenizer is not None:
        command += ["--tokenizer", args.tokenizer]
    draft = args.export if args.export is not None else args.out
    return shlex.join([*command, "--draft-model", str(Path(draft).expanduser())])


def _bar(total, desc: str, unit: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)


def _log(msg: str) -> None:
    print(f"train-draft: {msg}", file=sys.stderr, flush=True)
