"""`specserve train-draft --out DIR`: train a draft model for a target on this machine.

1. The target answers a prompt set through this engine (self-distillation; nothing is
   downloaded). Answers land in DIR/data in shards; a rerun keeps finished shards.
2. A shallow copy of the target (its embedding and head rows, L of its layers) learns
   to predict those answers; DIR/checkpoint.pt is written as it goes and a rerun resumes.
   With --method eagle the draft is instead one decoder layer reading the target's own
   hidden states (engine/spec_decode/eagle.py): the target's features of every answer
   are computed once into DIR/eagle-features, and the draft is trained with
   training-time test over --ttt-steps unrolled drafting steps
   (engine/train_draft/eagle.py).
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
    g.add_argument(
        "--method",
        choices=("layers", "eagle"),
        default="layers",
        help="layers: the target's first --num-layers layers, exiting early; eagle: one "
        "layer reading the target's hidden states (serve it with --speculative-method eagle)",
    )
    g.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="decoder layers in the draft (layers method; default 2; an eagle draft has one)",
    )
    g.add_argument(
        "--aux-layers",
        default=None,
        metavar="L1,L2,..",
        help="eagle: the target layers whose input hidden states the draft reads "
        "(default: a low, a middle and a high one, e.g. 2,15,27 of 30)",
    )
    g.add_argument(
        "--ttt-steps",
        type=int,
        default=None,
        help="eagle: drafting steps unrolled in training (training-time test; default 3)",
    )
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
        "--time-budget",
        type=float,
        default=None,
        metavar="MINUTES",
        help="stop training once MINUTES have passed since the command started (data and "
        "features included): the step under way finishes, is checkpointed and the draft "
        "exported; a rerun resumes. The learning-rate schedule still spans --epochs",
    )
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
    from engine.train_draft.train import CHECKPOINT, check_checkpoint

    started = time.perf_counter()
    _check_args(args)
    out = Path(args.out).expanduser()
    if args.restart:
        (out / CHECKPOINT).unlink(missing_ok=True)  # the data waits for its manifest
    else:  # before the target loads: the settings known from the flags alone
        check_checkpoint(out, _record(args, _settings(args)))
    out.mkdir(parents=True, exist_ok=True)
    prompts = _prompts(args)
    target_dir, manifest, target_vocab, eos_ids, data = _make_data(args, out, prompts)
    from engine.train_draft.data import load_sequences

    sequences = load_sequences(out / "data")
    target = (Path(target_dir), manifest, target_vocab, eos_ids)
    if args.method == "eagle":
        return _train_and_export_eagle(args, out, target, sequences, data, started)
    return _train_and_export(args, out, target, sequences, data, started)


def _check_args(args: argparse.Namespace) -> None:
    if args.num_prompts is not None:
        check_int("--num-prompts", args.num_prompts, 1, None)
    check_int("--max-tokens", args.max_tokens, 1, 8192)
    check_int("--max-num-seqs", args.max_num_seqs, 1, 4096)
    if args.method == "eagle":
        if args.num_layers not in (None, 1):
            raise ValueError(
                f"--num-layers does not apply to --method eagle (its draft is one decoder "
                f"layer), got {args.num_layers}"
            )
        if args.ttt_steps is not None:
            check_int("--ttt-steps", args.ttt_steps, 1, 16)
        if args.aux_layers is not None:
            from engine.train_draft.eagle import parse_layers

            parse_layers(args.aux_layers)
    else:
        for flag, value in (("--aux-layers", args.aux_layers), ("--ttt-steps", args.ttt_steps)):
            if value is not None:
                raise ValueError(f"{flag} applies to --method eagle only")
        if args.num_layers is not None:
            check_int("--num-layers", args.num_layers, 1, 64)
    if args.time_budget is not None and not args.time_budget > 0:
        raise ValueError(f"--time-budget must be > 0 minutes, got {args.time_budget}")
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
    if any((path / name).exists() for name in ("data", "checkpoint.pt", "eagle-features")):
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
    if args.method == "eagle":  # refuse before generating
        _aux_layers(args, loaded.arch.num_layers)
    else:
        layer_sources(loaded.arch.num_layers, _num_layers(args))
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


def _num_layers(args) -> int:
    return 2 if args.num_layers is None else args.num_layers


def _aux_layers(args, num_target_layers: int | None) -> list[int]:
    """--aux-layers, checked against the target's layers; the default for the target
    when not given ([] while the target is not known yet)."""
    from engine.spec_decode.eagle import check_aux_layers, default_aux_layers
    from engine.train_draft.eagle import parse_layers

    if args.aux_layers is None:
        return [] if num_target_layers is None else default_aux_layers(num_target_layers)
    layers = parse_layers(args.aux_layers)
    if num_target_layers is not None:
        if layers[-1] >= num_target_layers:
            raise ValueError(
                f"--aux-layers must name layers of the target's {num_target_layers} "
                f"(0 to {num_target_layers - 1}), got {args.aux_layers}"
            )
        check_aux_layers(layers, num_target_layers)
    return layers


def _settings(args, num_target_layers: int | None = None):
    from engine.loader import cpu_has_native_bf16
    from engine.train_draft.train import TrainSettings

    if args.train_dtype == "auto":
        bf16 = cpu_has_native_bf16()
    else:
        bf16 = args.train_dtype == "bfloat16"
    common = dict(
        vocab_size=args.draft_vocab,
        epochs=args.epochs,
        lr=args.lr,
        tokens_per_batch=args.tokens_per_batch,
        seed=args.seed,
        bf16=bf16,
    )
    if args.method == "eagle":
        from engine.train_draft.eagle import EagleSettings

        return EagleSettings(
            num_layers=1,
            ttt_steps=3 if args.ttt_steps is None else args.ttt_steps,
            aux_layers=_aux_layers(args, num_target_layers),
            **common,
        )
    return TrainSettings(num_layers=_num_layers(args), **common)


def _record(args, settings, made_with: dict | None = None) -> dict:
    """What the checkpoint must have been made with (train.checkpoint_record)."""
    if args.method == "eagle":
        from engine.train_draft.eagle import eagle_record

        return eagle_record(settings, made_with)
    from engine.train_draft.train import checkpoint_record

    return checkpoint_record(settings, made_with)


def _deadline(args, started: float) -> float | None:
    return None if args.time_budget is None else started + 60.0 * args.time_budget


def _summary(args, data, training: dict) -> dict:
    import torch

    return {
        "command": shlex.join(getattr(args, "argv", ["specserve", "train-draft"])),
        "data": {
            "answers": data.num_sequences,
            "response_tokens": data.num_response_tokens,
            "generation_seconds": round(data.seconds, 1),
        },
        "training": training,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
    }


def _train_and_export(args, out, target, sequences, data, started):
    target_dir, manifest, target_vocab, eos_ids = target
    import torch

    from engine.train_draft.data import MANIFEST_FLAGS
    from engine.train_draft.model import DraftLM, choose_vocab
    from engine.train_draft.train import check_checkpoint, checkpoint_record, export, train

    settings = _settings(args)
    torch.manual_seed(args.seed)
    vocab = choose_vocab(sequences, target_vocab, min(args.draft_vocab, target_vocab), eos_ids)
    model = DraftLM(target_dir, settings.num_layers, vocab)
    # the target and its answers: the checkpoint was trained from and on them too
    made_with = {MANIFEST_FLAGS.get(k, k): v for k, v in manifest.items()}
    check_checkpoint(out, checkpoint_record(settings, made_with))  # before the bar: one line
    bar = _bar(None, "training", "step")

    def progress(step: int, total: int, loss: float) -> None:
        bar.total = total
        bar.n = step
        bar.set_postfix_str(f"loss {loss:.3f}", refresh=False)
        bar.refresh()

    def on_epoch(epoch: int, top1: float) -> None:
        bar.write(f"train-draft: epoch {epoch}/{args.epochs}: held-out top-1 {top1:.3f}")

    deadline = _deadline(args, started)
    try:
        result = train(model, sequences, out, settings, progress, made_with, deadline, on_epoch)
    finally:
        bar.close()
    training = {
        "steps": result.steps,
        "seconds": round(result.seconds, 1),
        "heldout_top1_by_epoch": [round(x, 4) for x in result.heldout_top1_by_epoch],
    }
    if result.stopped_by_time_budget:
        _log(f"--time-budget: stopped after step {result.steps} of {result.total_steps}")
        training["stopped_by_time_budget"] = {
            "minutes": args.time_budget,
            "of_steps": result.total_steps,
            "heldout_top1": round(result.heldout_top1, 4),
        }
    summary = _summary(args, data, training)
    export(model, out, manifest["target"], settings, summary)
    if args.export is not None:
        exported = Path(args.export).expanduser()
        exported.mkdir(parents=True, exist_ok=True)
        export(model, exported, manifest["target"], settings, summary)
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    _log(
        f"draft: {settings.num_layers} layers, {len(vocab)}-token head, {size_mb:.1f} MB; held-out "
        f"top-1 agreement with the target {result.heldout_top1:.3f}; "
        f"{time.perf_counter() - started:.0f} s in all"
    )
    print(f"serve it with: {serve_hint(args)}")
    return 0


def _train_and_export_eagle(args, out, target, sequences, data, started):
    target_dir, manifest, target_vocab, eos_ids = target
    import torch

    from engine.loader import read_json
    from engine.train_draft.data import MANIFEST_FLAGS
    from engine.train_draft.eagle import (
        EagleTrainModel,
        ensure_features,
        export_eagle,
        format_layers,
        train_eagle,
    )
    from engine.train_draft.model import choose_vocab
    from engine.train_draft.train import check_checkpoint

    num_target_layers = int(read_json(target_dir / "config.json")["num_hidden_layers"])
    settings = _settings(args, num_target_layers)
    made_with = {MANIFEST_FLAGS.get(k, k): v for k, v in manifest.items()}
    check_checkpoint(out, _record(args, settings, made_with))  # before the bars: one line
    bars = []  # the features' bar, when there are features to compute
    feature_start = time.perf_counter()

    def feature_progress(done: int, total: int) -> None:
        if not bars:
            bars.append(_bar(total, "features", "token"))
        bars[0].n = done
        bars[0].refresh()

    try:
        features = ensure_features(
            target_dir, out / "data", out, settings.aux_layers, settings.max_seq_len,
            made_with, feature_progress, log=_log,
        )  # fmt: skip
    finally:
        for bar in bars:
            bar.close()
    feature_seconds = time.perf_counter() - feature_start
    if bars:
        _log(f"features: {bars[0].total} tokens computed in {feature_seconds:.0f} s")
    else:
        _log("features: all resumed")
    torch.manual_seed(args.seed)
    vocab = choose_vocab(sequences, target_vocab, min(args.draft_vocab, target_vocab), eos_ids)
    model = EagleTrainModel(target_dir, vocab, settings.aux_layers)
    bar = _bar(None, "training", "step")

    def progress(step: int, total: int, loss: float) -> None:
        bar.total = total
        bar.n = step
        bar.set_postfix_str(f"loss {loss:.3f}", refresh=False)
        bar.refresh()

    def on_epoch(epoch: int, e) -> None:
        bar.write(
            f"train-draft: epoch {epoch}/{args.epochs}: held-out {e.tokens_per_verification:.3f} "
            f"tokens/verification (greedy, k=4), depth-0 top-1 {e.top1:.3f}"
        )

    deadline = _deadline(args, started)
    try:
        result = train_eagle(
            model, sequences, features, out, settings, progress, made_with, deadline, on_epoch
        )
    finally:
        bar.close()
    final = result.final
    training = {
        "steps": result.steps,
        "seconds": round(result.seconds, 1),
        "feature_seconds": round(feature_seconds, 1),
        "ttt_steps": settings.ttt_steps,
        "heldout_tokens_per_verification_by_epoch": [
            round(e.tokens_per_verification, 4) for e in result.by_epoch
        ],
        "heldout_top1_by_epoch": [round(e.top1, 4) for e in result.by_epoch],
        "heldout_accept_by_depth": [round(x, 4) for x in final.accept_by_depth] if final else [],
    }
    if result.stopped_by_time_budget:
        _log(f"--time-budget: stopped after step {result.steps} of {result.total_steps}")
        training["stopped_by_time_budget"] = {
            "minutes": args.time_budget,
            "of_steps": result.total_steps,
            "heldout_tokens_per_verification": round(final.tokens_per_verification, 4),
            "heldout_top1": round(final.top1, 4),
        }
    summary = _summary(args, data, training)
    export_eagle(model, out, manifest["target"], settings, summary)
    if args.export is not None:
        export_eagle(model, Path(args.export).expanduser(), manifest["target"], settings, summary)
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    tpv = final.tokens_per_verification if final else float("nan")
    top1 = final.top1 if final else float("nan")
    _log(
        f"draft: eagle, aux layers {format_layers(settings.aux_layers)}, {len(vocab)}-token "
        f"head, {size_mb:.1f} MB; held-out {tpv:.3f} tokens/verification (greedy, k=4), "
        f"depth-0 top-1 {top1:.3f}; {time.perf_counter() - started:.0f} s in all"
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
    if getattr(args, "method", "layers") == "eagle":
        command += ["--speculative-method", "eagle"]
    draft = args.export if args.export is not None else args.out
    return shlex.join([*command, "--draft-model", str(Path(draft).expanduser())])


def _bar(total, desc: str, unit: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)


def _log(msg: str) -> None:
    print(f"train-draft: {msg}", file=sys.stderr, flush=True)
