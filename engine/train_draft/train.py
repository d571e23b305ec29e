"""Train the draft on self-distilled sequences, with checkpoints, and export it.

The loss is cross-entropy on response tokens only (the prompt is context, not the
target's output) over the draft vocabulary; tokens outside it are never proposed and
carry no loss. Sampled answers make this the forward KL to the target's distribution
in expectation, greedy ones its argmax. Batches are sequences of similar length, padded,
shuffled per epoch from ``seed``; 5% of the sequences are held out and the top-1
agreement with the target on them is reported after each epoch: a proxy for the first
draft's acceptance under greedy decoding.

The checkpoint records what it was made with (``checkpoint_record``: the settings, the
target, the data); a rerun resumes only a checkpoint made with the same, so that the
draft is the one a fresh run with these flags makes, as its draft.json says.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from engine.spec_decode.trained_draft import DRAFT_FILE, FORMAT, FORMAT_VERSION, embed_probe_ids
from engine.train_draft.data import Sequence, setting_changes
from engine.train_draft.model import DraftLM

CHECKPOINT = "checkpoint.pt"


@dataclass
class TrainSettings:
    num_layers: int = 2
    vocab_size: int = 8192
    epochs: int = 6
    lr: float = 1e-3
    warmup_steps: int = 50
    tokens_per_batch: int = 4096
    max_seq_len: int = 512
    seed: int = 0
    checkpoint_every: int = 100
    bf16: bool = False  # autocast the forward and backward in bfloat16 (CPU with native bf16)


# The settings a checkpoint depends on, by the flag that sets them: resumed under any
# other value, the layers would be trained for another head (--draft-vocab), shape
# (--num-layers), batching, order, schedule or numerics. checkpoint_every is not here:
# resuming is exact whatever it is.
SETTING_FLAGS = {
    "num_layers": "--num-layers",
    "vocab_size": "--draft-vocab",
    "epochs": "--epochs",
    "lr": "--lr",
    "tokens_per_batch": "--tokens-per-batch",
    "seed": "--seed",
    "bf16": "--train-dtype",
    "warmup_steps": "warmup_steps",  # no flag: changes only with specserve
    "max_seq_len": "max_seq_len",
}


@dataclass
class TrainResult:
    steps: int
    seconds: float
    train_tokens: int
    heldout_top1: float  # at the last step
    heldout_top1_by_epoch: list[float]
    total_steps: int = 0
    stopped_by_time_budget: bool = False


def checkpoint_record(settings: TrainSettings, made_with: dict | None = None) -> dict:
    """Flag -> value of what a checkpoint depends on: ``settings``, and ``made_with``
    (the target and the data: its manifest, see data.MANIFEST_FLAGS)."""
    record = {"--method": "layers"}  # engine/train_draft/eagle.py records "eagle"
    record.update({flag: getattr(settings, name) for name, flag in SETTING_FLAGS.items()})
    record["--train-dtype"] = "bfloat16" if settings.bf16 else "float32"
    return {**record, **(made_with or {})}


def check_checkpoint(out_dir: Path, record: dict, made: dict | None = None) -> None:
    """Refuse ``out_dir``'s checkpoint unless it was made with ``record`` (the entries
    given; ``made``: its own record, when already loaded), in one line naming each flag
    that differs and both values."""
    path = out_dir / CHECKPOINT
    if made is None:
        if not path.exists():
            return
        # mmap: only the small record is read, not the weights and optimizer state
        made = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("made_with")
    if made is None:
        raise ValueError(
            f"{path} does not record the settings it was made with (an older specserve); "
            "use another --out or --restart"
        )
    made = {"--method": "layers", **made}  # checkpoints from before --method: layers
    changes = setting_changes(made, record)
    if changes:
        raise ValueError(
            f"{path} was made with other settings ({'; '.join(changes)}); "
            "use another --out, the same flags, or --restart"
        )


def split_heldout(sequences: list[Sequence], seed: int) -> tuple[list[Sequence], list[Sequence]]:
    order = list(range(len(sequences)))
    random.Random(seed).shuffle(order)
    num_heldout = max(1, len(sequences) // 20) if len(sequences) >= 4 else 0
    heldout = [sequences[i] for i in order[:num_heldout]]
    return [sequences[i] for i in order[num_heldout:]], heldout


def make_batches(sequences: list[Sequence], settings: TrainSettings) -> list[list[int]]:
    """Indices of sequences grouped by length, at most ``tokens_per_batch`` padded tokens."""
    lengths = [min(len(s.token_ids), settings.max_seq_len) for s in sequences]
    order = sorted(range(len(sequences)), key=lambda i: lengths[i])
    batches, current, longest = [], [], 0
    for i in order:
        longest_if = max(longest, lengths[i])
        if current and longest_if * (len(current) + 1) > settings.tokens_per_batch:
            batches.append(current)
            current, longest_if = [], lengths[i]
        current.append(i)
        longest = longest_if
    if current:
        batches.append(current)
    return batches


def collate(sequences: list[Sequence], index_of: np.ndarray, max_len: int):
    """(input_ids [B, T], attention_mask [B, T], labels [B, T] in draft-vocab ids, -100
    where no loss: prompt, padding, tokens outside the draft vocabulary)."""
    length = min(max(len(s.token_ids) for s in sequences), max_len)
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros(len(sequences), length, dtype=torch.long)
    labels = torch.full((len(sequences), length), -100, dtype=torch.long)
    for row, seq in enumerate(sequences):
        tokens = seq.token_ids[:length]
        n = len(tokens)
        ids[row, :n] = torch.from_numpy(tokens)
        mask[row, :n] = 1
        # position t predicts token t + 1; a loss where t + 1 is a response token
        nxt = index_of[tokens[1:]]
        start = max(seq.prompt_len - 1, 0)
        labels[row, start : n - 1] = torch.from_numpy(nxt[start:])
    return ids, mask, labels


def lr_at(step: int, total: int, settings: TrainSettings) -> float:
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, total - settings.warmup_steps)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def train(
    model: DraftLM,
    sequences: list[Sequence],
    out_dir: Path,
    settings: TrainSettings,
    progress=None,
    made_with: dict | None = None,
    deadline: float | None = None,
    on_epoch=None,
) -> TrainResult:
    """Train ``model`` in place; resumes from ``out_dir/checkpoint.pt`` when it was made
    with the same settings, target and ``made_with`` (see ``checkpoint_record``), and
    refuses it otherwise. ``deadline`` (a ``time.perf_counter()`` value): stop after the
    step that passes it, checkpointed; ``on_epoch(epoch, heldout_top1)`` after each epoch."""
    record = checkpoint_record(settings, made_with)
    torch.manual_seed(settings.seed)
    train_seqs, heldout = split_heldout(sequences, settings.seed)
    if not train_seqs:
        raise ValueError("no training sequences: generate more data (--num-prompts)")
    index_of = np.full(model.hf_config["vocab_size"], -100, dtype=np.int64)
    index_of[model.draft_vocab.numpy()] = np.arange(len(model.draft_vocab))
    batches = make_batches(train_seqs, settings)
    total = settings.epochs * len(batches)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step, by_epoch, seconds = _resume(model, optimizer, out_dir, record)
    start = time.perf_counter()
    train_tokens = 0
    stopped = False
    final = by_epoch[-1] if by_epoch else float("nan")
    model.train()
    while step < total and not stopped:
        epoch, within = divmod(step, len(batches))
        order = list(range(len(batches)))
        random.Random(settings.seed * 7919 + epoch).shuffle(order)
        for position in range(within, len(batches)):
            batch = [train_seqs[i] for i in batches[order[position]]]
            ids, mask, labels = collate(batch, index_of, settings.max_seq_len)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, total, settings)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
                logits = model(ids, mask)
            loss = torch.nn.functional.cross_entropy(
                logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            train_tokens += int((labels != -100).sum())
            if progress is not None:
                progress(step, total, float(loss.detach()))
            if deadline is not None and time.perf_counter() >= deadline and step < total:
                stopped = True
                break
            if step % settings.checkpoint_every == 0 and step < total:
                _save_checkpoint(model, optimizer, out_dir, record, step, by_epoch, seconds, start)
        final = evaluate(model, heldout, index_of, settings)
        if not stopped:
            by_epoch.append(final)
            if on_epoch is not None:
                on_epoch(len(by_epoch), final)
        model.train()
        _save_checkpoint(model, optimizer, out_dir, record, step, by_epoch, seconds, start)
    model.eval()
    return TrainResult(
        steps=step,
        seconds=seconds + time.perf_counter() - start,
        train_tokens=train_tokens,
        heldout_top1=final,
        heldout_top1_by_epoch=by_epoch,
        total_steps=total,
        stopped_by_time_budget=stopped,
    )


@torch.no_grad()
def evaluate(model: DraftLM, heldout: list[Sequence], index_of, settings: TrainSettings) -> float:
    """Top-1 agreement of the draft with the target's next token on held-out responses."""
    if not heldout:
        return float("nan")
    model.eval()
    hits = count = 0
    for batch in make_batches(heldout, settings):
        ids, mask, labels = collate([heldout[i] for i in batch], index_of, settings.max_seq_len)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
            logits = model(ids, mask)
        scored = _scored_positions(ids, mask, heldout, batch, settings.max_seq_len)
        predicted = logits.argmax(-1)
        hits += int(((predicted == labels) & scored).sum())
        count += int(scored.sum())
    return hits / max(count, 1)


def _scored_positions(ids, mask, heldout, batch, max_len) -> torch.Tensor:
    """Response positions, including tokens outside the draft vocabulary (counted as misses)."""
    scored = torch.zeros_like(mask, dtype=torch.bool)
    for row, i in enumerate(batch):
        n = min(len(heldout[i].token_ids), max_len)
        scored[row, max(heldout[i].prompt_len - 1, 0) : n - 1] = True
    return scored


def _save_checkpoint(model, optimizer, out_dir, record, step, by_epoch, seconds, start) -> None:
    state = {
        "made_with": record,
        "trained": model.trained_state(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "by_epoch": by_epoch,
        "seconds": seconds + time.perf_counter() - start,
    }
    tmp = out_dir / (CHECKPOINT + ".tmp")
    torch.save(state, tmp)
    tmp.replace(out_dir / CHECKPOINT)


def _resume(model, optimizer, out_dir: Path, record: dict):
    path = out_dir / CHECKPOINT
    if not path.exists():
        return 0, [], 0.0
    state = torch.load(path, map_location="cpu", weights_only=True)
    check_checkpoint(out_dir, record, made=state.get("made_with"))
    own = dict(model.named_parameters())  # trained_state's names
    with torch.no_grad():
        for name, tensor in state["trained"].items():
            own[name].copy_(tensor)
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"]), list(state["by_epoch"]), float(state["seconds"])


def export(
    model: DraftLM,
    out_dir: Path,
    target_name: str,
    settings: TrainSettings,
    summary: dict,
    save_dtype: torch.dtype = torch.bfloat16,
) -> None:
    """config.json + model.safetensors (layers and norm, HF names, plus the draft vocabulary
    and an embedding probe) + draft.json (what it drafts for, how it was made)."""
    write_draft(
        out_dir,
        model.trained_state(),
        model.draft_vocab,
        model.model.embed_tokens.weight,
        model.hf_config,
        target_name,
        {
            "num_layers": model.hf_config["num_hidden_layers"],
            "layers_from": model.layers_from,
            "settings": asdict(settings),
            **summary,
        },
        save_dtype,
    )


def write_draft(
    out_dir: Path,
    state: dict[str, torch.Tensor],
    draft_vocab: torch.Tensor,
    embed: torch.Tensor,
    hf_config: dict,
    target_name: str,
    meta: dict,
    save_dtype: torch.dtype = torch.bfloat16,
) -> None:
    """What every train-draft method writes: model.safetensors (the trained ``state`` in
    ``save_dtype``, the draft vocabulary, 16 rows of the target's ``embed`` that tell
    its target from another), config.json (``hf_config``) and draft.json (format, target
    and vocabulary sizes, then the method's own ``meta``)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.to(save_dtype).contiguous() for name, t in state.items()}
    tensors["specserve.draft_vocab"] = draft_vocab.clone()
    probe_ids = embed_probe_ids(hf_config["vocab_size"])
    tensors["specserve.embed_probe"] = embed[probe_ids].float().clone()
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / "model.safetensors").chmod(0o644)  # safetensors writes 0600; servers run as others
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "target": target_name,
        "target_vocab_size": hf_config["vocab_size"],
        "draft_vocab_size": len(draft_vocab),
        **meta,
    }
    (out_dir / DRAFT_FILE).write_text(json.dumps(meta, indent=2) + "\n")
