"""Train an EAGLE draft (``specserve train-draft --method eagle``).

The math and the file format are fixed by engine/spec_decode/eagle.py's docstring; this
module trains a draft that follows it. In short: the draft is one decoder layer that
reads, at position j, the token x_j and a hidden state h_{j-1}: the target's features
``g_{j-1}`` (the residual stream entering each of ``aux_layers``, concatenated) fused by
``fc`` where the target has computed position j-1, its own output o_{j-1} where it has
drafted it.

Features. The target (transformers, float32, from its float weights) runs once over
every training sequence (its first ``max_seq_len`` tokens); g is rounded to bfloat16
and stored under OUT/eagle-features, one file per data shard (``shard-NNNNN.npy``:
int16 bit patterns of the bfloat16 rows, memory-mapped when training; ``.json`` beside
it: rows and a hash of the tokens it was made from). ``manifest.json`` records the
aux layers, ``max_seq_len`` and the data's manifest (the target and its answers);
features made otherwise are computed again, a shard whose tokens changed too.

Training-time test (TTT). Depth 0 is teacher-forced: position j reads x_j and
f_{j-1} = fc(g_{j-1}) (h_{-1} = 0) and predicts x_{j+1}, causal over depth 0. Depth
s >= 1 at position j is the s-th step of a draft from the root r = j - s: it reads x_j
(the ground truth: the draft had to be right so far for this step to count) and the
depth-(s-1) output o^{s-1}_{j-1}; its query attends to the depth-0 keys at positions
<= r and to the depth-t key at position r + t for t = 1..s: exactly what the paged
cache holds when the draft is served. One dense boolean mask over the keys of depths
0..s does it (``ttt_mask``). The loss is sum_s w^s CE_s over s < ``ttt_steps``, each
CE over the positions whose label is a response token in the draft vocabulary and
whose root is a position serving drafts from (the last prompt token or later).

Held-out evaluation (5% of the sequences, as the layers method holds out): the
expected tokens per verification of greedy drafting with k = 4 drafts,
1 + sum_{s=0..3} P(the argmax at depths 0..s all equal the answer's tokens), over the
roots in the held-out responses with 4 tokens after them, and the depth-0 top-1
agreement over every response position (a token outside the draft vocabulary is a miss).

Initialization: the decoder layer and the final norm are the target's last layer and
final norm (a draft that starts as the target's top layer); ``fc`` has PyTorch's
default Linear init; ``in_proj`` passes the normalized embedding through (identity on
the embedding half) and starts the hidden half small (normal, std 0.02), so the first
steps see the token while fc learns what to bring. The embedding and the head rows
for the draft vocabulary are the target's, frozen.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.loader import iter_safetensors, read_json
from engine.model_config import ModelArchConfig
from engine.models.layers import rope_inv_freq
from engine.spec_decode.eagle import METHOD, check_aux_layers
from engine.train_draft.data import Sequence, data_shards, load_shard, setting_changes
from engine.train_draft.model import draft_hf_config
from engine.train_draft.train import (
    TrainSettings,
    _save_checkpoint,
    check_checkpoint,
    checkpoint_record,
    collate,
    lr_at,
    make_batches,
    split_heldout,
    write_draft,
)

FEATURES_DIR = "eagle-features"
EVAL_DEPTHS = 4  # tokens per verification at k = 4 drafts


@dataclass
class EagleSettings(TrainSettings):
    num_layers: int = 1  # one decoder layer, always
    ttt_steps: int = 3
    ttt_weight: float = 0.8  # the loss at depth s weighs ttt_weight ** s
    aux_layers: list[int] = field(default_factory=list)


@dataclass
class EagleEval:
    tokens_per_verification: float  # greedy, k = EVAL_DEPTHS drafts
    top1: float  # depth 0
    accept_by_depth: list[float]  # P(depths 0..s all right), s < EVAL_DEPTHS


@dataclass
class EagleResult:
    steps: int
    total_steps: int
    seconds: float
    train_tokens: int
    by_epoch: list[EagleEval]
    final: EagleEval | None  # at the last step (the last epoch's, or where the budget stopped)
    stopped_by_time_budget: bool


def eagle_record(settings: EagleSettings, made_with: dict | None = None) -> dict:
    """What an EAGLE checkpoint depends on, by flag (see train.checkpoint_record); the
    aux layers only when known (from --aux-layers, or resolved for the target)."""
    record = checkpoint_record(settings, made_with)
    record["--method"] = METHOD
    record["--ttt-steps"] = settings.ttt_steps
    record["ttt_weight"] = settings.ttt_weight
    if settings.aux_layers:
        record["--aux-layers"] = format_layers(settings.aux_layers)
    return record


def format_layers(layers) -> str:
    return ",".join(str(int(x)) for x in layers)


def parse_layers(text: str) -> list[int]:
    """'2,15,27' -> [2, 15, 27]; ValueError naming --aux-layers otherwise."""
    try:
        layers = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--aux-layers must be comma-separated layer indices, got {text!r}"
        ) from None
    if layers != sorted(set(layers)) or layers[0] < 0:
        raise ValueError(f"--aux-layers must be distinct ascending layer indices, got {text!r}")
    return layers


# ---- features -----------------------------------------------------------------------------
class FeatureStore:
    """The target's features of each training sequence (bfloat16 [n, A * H]), read from
    the memory-mapped shards one sequence at a time."""

    def __init__(self, arrays: list[np.ndarray], index: list[tuple[int, int, int]], width: int):
        self.arrays = arrays
        self.index = index  # per sequence: (shard, first row, rows)
        self.width = width

    def __len__(self) -> int:
        return len(self.index)

    def rows(self, i: int) -> int:
        return self.index[i][2]

    def get(self, i: int) -> torch.Tensor:
        shard, start, n = self.index[i]
        rows = np.array(self.arrays[shard][start : start + n])  # copied out of the map
        return torch.from_numpy(rows).view(torch.bfloat16)


def features_manifest(aux_layers: list[int], max_seq_len: int, made_with: dict) -> dict:
    """What the features depend on: the aux layers, the tokens kept per sequence, the
    target and its answers (``made_with``: the data manifest by flag)."""
    return {
        "--aux-layers": format_layers(aux_layers),
        "max_seq_len": max_seq_len,
        "storage": "bfloat16",
        "compute": "float32",
        **made_with,
    }


def ensure_features(
    target_dir: Path,
    data_dir: Path,
    out_dir: Path,
    aux_layers: list[int],
    max_seq_len: int,
    made_with: dict,
    progress: Callable[[int, int], None] | None = None,
    log: Callable[[str], None] | None = None,
    tokens_per_batch: int = 4096,
) -> FeatureStore:
    """The features of every sequence in ``data_dir`` (``load_sequences`` order),
    computing those not already under ``out_dir/eagle-features`` for this manifest;
    ``progress(tokens_done, tokens_to_compute)`` as batches finish."""
    directory = out_dir / FEATURES_DIR
    manifest = features_manifest(aux_layers, max_seq_len, made_with)
    manifest_path = directory / "manifest.json"
    if manifest_path.exists():
        changes = setting_changes(json.loads(manifest_path.read_text()), manifest)
        if changes:
            if log is not None:
                log(f"features made with other settings ({'; '.join(changes)}): computing again")
            shutil.rmtree(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if not manifest_path.exists():
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    hidden = int(read_json(target_dir / "config.json")["hidden_size"])
    width = len(aux_layers) * hidden
    shards, todo = [], []
    for path in data_shards(data_dir):
        seqs = load_shard(path)
        lengths = [min(len(s.token_ids), max_seq_len) for s in seqs]
        stamp = {
            "rows": sum(lengths),
            "width": width,
            "tokens_sha256": _tokens_digest(seqs, lengths),
        }
        feature_path, stamp_path = directory / f"{path.stem}.npy", directory / f"{path.stem}.json"
        shards.append((feature_path, lengths))
        done = (
            feature_path.exists()
            and stamp_path.exists()
            and json.loads(stamp_path.read_text()) == stamp
        )
        if not done:
            todo.append((seqs, lengths, feature_path, stamp_path, stamp))
    if todo:
        total = sum(stamp["rows"] for *_, stamp in todo)
        target = feature_model(target_dir, aux_layers)
        done_tokens = 0
        for seqs, lengths, feature_path, stamp_path, stamp in todo:
            stamp_path.unlink(missing_ok=True)
            features = np.empty((stamp["rows"], width), dtype=np.int16)
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
            for batch in _length_batches(lengths, tokens_per_batch):
                g = compute_features(
                    target, aux_layers, [seqs[i].token_ids[: lengths[i]] for i in batch]
                )
                for row, i in enumerate(batch):
                    start = int(starts[i])
                    features[start : start + lengths[i]] = (
                        g[row, : lengths[i]].view(torch.int16).numpy()
                    )
                done_tokens += sum(lengths[i] for i in batch)
                if progress is not None:
                    progress(done_tokens, total)
            tmp = feature_path.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                np.save(f, features)
            tmp.replace(feature_path)  # there whole or not at all
            stamp_path.write_text(json.dumps(stamp) + "\n")
    arrays, index = [], []
    for shard, (feature_path, lengths) in enumerate(shards):
        arrays.append(np.load(feature_path, mmap_mode="r"))
        start = 0
        for n in lengths:
            index.append((shard, start, n))
            start += n
    return FeatureStore(arrays, index, width)


def _tokens_digest(seqs: list[Sequence], lengths: list[int]) -> str:
    digest = hashlib.sha256()
    for seq, n in zip(seqs, lengths):
        digest.update(np.int64(n).tobytes())
        digest.update(seq.token_ids[:n].astype(np.int64).tobytes())
    return digest.hexdigest()[:16]


def _length_batches(lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, current = [], []
    for i in order:
        if current and lengths[i] * (len(current) + 1) > tokens_per_batch:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def feature_model(target_dir: Path, aux_layers: list[int]) -> nn.Module:
    """The target's transformers base model (float32, eval) cut after the last aux
    layer: ``hidden_states[l]`` for every aux layer l, nothing after it computed."""
    from transformers import AutoConfig, AutoModel

    target_config = read_json(target_dir / "config.json")
    check_aux_layers(aux_layers, target_config["num_hidden_layers"])
    hf_config = draft_hf_config(target_config, max(aux_layers) + 1)
    config = AutoConfig.for_model(**hf_config)
    config._attn_implementation = "sdpa"
    model = AutoModel.from_config(config, dtype=torch.float32)
    own = model.state_dict()
    loaded = set()
    with torch.no_grad():
        for name, tensor in iter_safetensors(target_dir, torch.device("cpu")):
            short = name.removeprefix("model.")
            if short in own:
                own[short].copy_(tensor.float())
                loaded.add(short)
    missing = [n for n in own if n not in loaded and not n.endswith("inv_freq")]
    if missing:
        raise ValueError(f"{target_dir}: the target's checkpoint has no {missing[0]!r}")
    return model.eval()


@torch.no_grad()
def compute_features(model: nn.Module, aux_layers: list[int], sequences) -> torch.Tensor:
    """g [B, T, A * H] in bfloat16 for token id sequences (right-padded: the padding comes
    after every real token, so the causal target never reads it)."""
    length = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.as_tensor(seq)
    states = model(input_ids=ids, output_hidden_states=True).hidden_states
    return torch.cat([states[layer] for layer in aux_layers], dim=-1).to(torch.bfloat16)


# ---- the model ----------------------------------------------------------------------------
class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class _Attention(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        q, kv, bias = (
            arch.num_heads * arch.head_dim,
            arch.num_kv_heads * arch.head_dim,
            arch.attention_bias,
        )
        self.q_proj = nn.Linear(arch.hidden_size, q, bias=bias)
        self.k_proj = nn.Linear(arch.hidden_size, kv, bias=bias)
        self.v_proj = nn.Linear(arch.hidden_size, kv, bias=bias)
        self.o_proj = nn.Linear(q, arch.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(arch)
        self.mlp = _MLP(arch)
        self.input_layernorm = _RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(arch.hidden_size, arch.rms_norm_eps)


def ttt_mask(length: int, depth: int, device=None) -> torch.Tensor:
    """[T, (depth + 1) * T] bool, True where a depth-``depth`` query at position j (the
    row) reads a key of the concatenated depths 0..depth (the column): depth-0 keys at
    positions <= j - depth, and the depth-t key at position j - depth + t, t = 1..depth."""
    j = torch.arange(length, device=device)[:, None]
    p = torch.arange(length, device=device)[None, :]
    blocks = [p <= j - depth] + [p == j - depth + t for t in range(1, depth + 1)]
    return torch.cat(blocks, dim=1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE (apply_rope in engine/models/layers.py's convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _shift(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H] -> the row before each position, zeros before the first."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


class EagleTrainModel(nn.Module):
    """The EAGLE draft as trained: parameters named as the draft's safetensors holds
    them (``eagle.*``, ``model.layers.0.*``, ``model.norm.weight``), float32; the
    target's embedding and head rows for ``draft_vocab`` as frozen buffers."""

    def __init__(self, target_dir: Path, draft_vocab: np.ndarray, aux_layers: list[int]) -> None:
        super().__init__()
        target_dir = Path(target_dir)
        target_config = read_json(target_dir / "config.json")
        arch = ModelArchConfig.from_hf_config(target_config)
        self.arch = arch
        self.aux_layers = check_aux_layers(aux_layers, arch.num_layers)
        self.hf_config = draft_hf_config(target_config, 1)
        hidden = arch.hidden_size
        self.eagle = nn.Module()
        self.eagle.fc = nn.Linear(len(self.aux_layers) * hidden, hidden, bias=False)
        self.eagle.embed_norm = _RMSNorm(hidden, arch.rms_norm_eps)
        self.eagle.hidden_norm = _RMSNorm(hidden, arch.rms_norm_eps)
        self.eagle.in_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([_DecoderLayer(arch)])
        self.model.norm = _RMSNorm(hidden, arch.rms_norm_eps)
        weights = dict(iter_safetensors(target_dir, torch.device("cpu")))
        head_name = "lm_head.weight"
        if head_name not in weights or arch.tie_word_embeddings:
            head_name = "model.embed_tokens.weight"
        self.register_buffer("draft_vocab", torch.as_tensor(draft_vocab).long(), persistent=False)
        self.register_buffer(
            "embed", weights["model.embed_tokens.weight"].float().contiguous(), persistent=False
        )
        self.register_buffer(
            "head", weights[head_name].float()[self.draft_vocab].contiguous(), persistent=False
        )
        self.register_buffer(
            "inv_freq",
            rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling),
            persistent=False,
        )
        self._init_from_target(weights)

    @torch.no_grad()
    def _init_from_target(self, weights: dict[str, torch.Tensor]) -> None:
        last = self.arch.num_layers - 1
        for name, param in self.model.named_parameters():
            source = f"model.{name}"
            if name.startswith("layers.0."):
                source = f"model.layers.{last}.{name.removeprefix('layers.0.')}"
            if source not in weights:
                raise ValueError(
                    f"the target's checkpoint has no {source!r} to initialize {name!r}"
                )
            param.copy_(weights[source].float())
        hidden = self.arch.hidden_size
        in_proj = self.eagle.in_proj.weight
        in_proj[:, :hidden].copy_(torch.eye(hidden))
        in_proj[:, hidden:].normal_(0.0, 0.02)

    def trained_state(self) -> dict[str, torch.Tensor]:
        """Every trained tensor by its name in the draft's safetensors."""
        return {name: p.detach() for name, p in self.named_parameters()}

    def unroll(
        self, input_ids: torch.Tensor, features: torch.Tensor, depths: int
    ) -> list[torch.Tensor]:
        """o^s [B, T, H] for s < ``depths`` (see the module docstring): ``input_ids``
        [B, T], ``features`` g [B, T, A * H] (g_j at row j)."""
        batch, length = input_ids.shape
        arch = self.arch
        positions = torch.arange(length, device=input_ids.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)  # [T, head_dim]
        cos, sin = angles.cos(), angles.sin()
        embeds = self.eagle.embed_norm(self.embed[input_ids])
        hidden_in = _shift(self.eagle.fc(features.to(self.eagle.fc.weight.dtype)))
        layer = self.model.layers[0]
        attn = layer.self_attn
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs = []
        for depth in range(depths):
            u = self.eagle.in_proj(torch.cat([embeds, self.eagle.hidden_norm(hidden_in)], dim=-1))
            x = layer.input_layernorm(u)
            q = attn.q_proj(x).view(batch, length, arch.num_heads, arch.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(batch, length, arch.num_kv_heads, arch.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(batch, length, arch.num_kv_heads, arch.head_dim).transpose(1, 2)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            keys.append(k)
            values.append(v.to(k.dtype))
            mask = ttt_mask(length, depth, input_ids.device)
            out = F.scaled_dot_product_attention(
                q.to(k.dtype), torch.cat(keys, dim=2), torch.cat(values, dim=2),
                attn_mask=mask, enable_gqa=arch.num_heads != arch.num_kv_heads,
            )  # fmt: skip
            out = out.transpose(1, 2).reshape(batch, length, arch.num_heads * arch.head_dim)
            h = u + attn.o_proj(out)
            o = h + layer.mlp(layer.post_attention_layernorm(h))
            outs.append(o)
            hidden_in = _shift(o)
        return outs

    def logits(self, o: torch.Tensor) -> torch.Tensor:
        """Over the draft vocabulary [..., N]."""
        return F.linear(self.model.norm(o), self.head)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, depths: int):
        """Logits [B, T, N] of each depth s < ``depths``."""
        return [self.logits(o) for o in self.unroll(input_ids, features, depths)]


@torch.no_grad()
def unrolled_logits(
    model: EagleTrainModel, token_ids, features: torch.Tensor, depth: int
) -> torch.Tensor:
    """[T, N] float32: row j is the depth-``depth`` logits at position j, the draft of
    x_{j+1} ``depth`` steps after the root j - depth (teacher-forced tokens; rows
    j < depth have no root in the sequence). ``token_ids`` [T], ``features`` g [T, A*H]."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(1, -1)
    was_training = model.training
    model.eval()
    try:
        o = model.unroll(ids, features.float().reshape(1, ids.shape[1], -1), depth + 1)[depth]
        return model.logits(o)[0].float()
    finally:
        model.train(was_training)


def teacher_forced_logits(
    model: EagleTrainModel, token_ids, features: torch.Tensor
) -> torch.Tensor:
    """[T, N]: depth 0, every position reading the target's features of the one before."""
    return unrolled_logits(model, token_ids, features, 0)


# ---- training -----------------------------------------------------------------------------
def _batch(sequences, store: FeatureStore, indices, index_of, max_len):
    """(ids [B, T], features [B, T, A*H] float32, labels [B, T], first root [B, 1])."""
    seqs = [sequences[i] for i in indices]
    ids, _, labels = collate(seqs, index_of, max_len)
    features = torch.zeros(len(seqs), ids.shape[1], store.width)
    for row, i in enumerate(indices):
        g = store.get(i)
        features[row, : g.shape[0]] = g.float()
    first_root = torch.tensor([[max(s.prompt_len - 1, 0)] for s in seqs])
    return ids, features, labels, first_root


def _loss(logits_by_depth, labels, first_root, weight: float):
    positions = torch.arange(labels.shape[1])[None, :]
    total = 0.0
    for depth, logits in enumerate(logits_by_depth):
        scored = (labels != -100) & (positions - depth >= first_root)
        if not bool(scored.any()):
            continue
        ce = F.cross_entropy(logits.float()[scored], labels[scored])
        total = total + weight**depth * ce
    return total


def train_eagle(
    model: EagleTrainModel,
    sequences: list[Sequence],
    features: FeatureStore,
    out_dir: Path,
    settings: EagleSettings,
    progress=None,
    made_with: dict | None = None,
    deadline: float | None = None,
    on_epoch: Callable[[int, EagleEval], None] | None = None,
) -> EagleResult:
    """Train ``model`` in place (resuming ``out_dir/checkpoint.pt`` when it was made with
    the same settings, target and data; refusing it otherwise). ``deadline`` (a
    ``time.perf_counter()`` value): stop after the step that passes it, checkpointed."""
    if len(features) != len(sequences):
        raise ValueError(f"{len(features)} feature rows for {len(sequences)} sequences")
    record = eagle_record(settings, made_with)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(settings.seed)
    train_ids, heldout_ids = split_heldout(list(range(len(sequences))), settings.seed)
    if not train_ids:
        raise ValueError("no training sequences: generate more data (--num-prompts)")
    index_of = np.full(model.arch.vocab_size, -100, dtype=np.int64)
    index_of[model.draft_vocab.numpy()] = np.arange(len(model.draft_vocab))
    batches = [
        [train_ids[i] for i in batch]
        for batch in make_batches([sequences[i] for i in train_ids], settings)
    ]
    total = settings.epochs * len(batches)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step, by_epoch, seconds = _resume(model, optimizer, out_dir, record)
    by_epoch = [EagleEval(**e) for e in by_epoch]
    start = time.perf_counter()
    train_tokens = 0
    stopped = False
    final = by_epoch[-1] if by_epoch else None
    model.train()
    while step < total and not stopped:
        epoch, within = divmod(step, len(batches))
        order = list(range(len(batches)))
        random.Random(settings.seed * 7919 + epoch).shuffle(order)
        for position in range(within, len(batches)):
            ids, g, labels, first_root = _batch(
                sequences, features, batches[order[position]], index_of, settings.max_seq_len
            )
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, total, settings)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
                logits = model(ids, g, settings.ttt_steps)
            loss = _loss(logits, labels, first_root, settings.ttt_weight)
            optimizer.zero_grad(set_to_none=True)
            if torch.is_tensor(loss):
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
            step += 1
            train_tokens += int((labels != -100).sum())
            if progress is not None:
                progress(step, total, float(loss.detach()) if torch.is_tensor(loss) else loss)
            if deadline is not None and time.perf_counter() >= deadline and step < total:
                stopped = True
                break
            if step % settings.checkpoint_every == 0 and step < total:
                _save(model, optimizer, out_dir, record, step, by_epoch, seconds, start)
        final = evaluate_eagle(model, sequences, features, heldout_ids, index_of, settings)
        model.train()
        if not stopped:
            by_epoch.append(final)
            if on_epoch is not None:
                on_epoch(len(by_epoch), final)
        _save(model, optimizer, out_dir, record, step, by_epoch, seconds, start)
    model.eval()
    return EagleResult(
        steps=step,
        total_steps=total,
        seconds=seconds + time.perf_counter() - start,
        train_tokens=train_tokens,
        by_epoch=by_epoch,
        final=final,
        stopped_by_time_budget=stopped,
    )


def _save(model, optimizer, out_dir, record, step, by_epoch, seconds, start) -> None:
    epochs = [asdict(e) for e in by_epoch]
    _save_checkpoint(model, optimizer, out_dir, record, step, epochs, seconds, start)


def _resume(model: EagleTrainModel, optimizer, out_dir: Path, record: dict):
    from engine.train_draft.train import CHECKPOINT

    path = out_dir / CHECKPOINT
    if not path.exists():
        return 0, [], 0.0
    state = torch.load(path, map_location="cpu", weights_only=True)
    check_checkpoint(out_dir, record, made=state.get("made_with"))
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in state["trained"].items():
            own[name].copy_(tensor)
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"]), list(state["by_epoch"]), float(state["seconds"])


@torch.no_grad()
def evaluate_eagle(
    model: EagleTrainModel,
    sequences: list[Sequence],
    features: FeatureStore,
    indices: list[int],
    index_of: np.ndarray,
    settings: EagleSettings,
) -> EagleEval:
    """Greedy tokens per verification at k = 4 and depth-0 top-1 on ``indices``."""
    if not indices:
        nan = float("nan")
        return EagleEval(nan, nan, [nan] * EVAL_DEPTHS)
    model.eval()
    chains = torch.zeros(EVAL_DEPTHS, dtype=torch.long)
    roots = hits = scored_count = 0
    for batch in make_batches([sequences[i] for i in indices], settings):
        chosen = [indices[i] for i in batch]
        ids, g, labels, first_root = _batch(
            sequences, features, chosen, index_of, settings.max_seq_len
        )
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
            outs = model.unroll(ids, g, EVAL_DEPTHS)
            predicted = [model.logits(o).argmax(-1) for o in outs]
        lengths = torch.tensor(
            [[min(len(sequences[i].token_ids), settings.max_seq_len)] for i in chosen]
        )
        positions = torch.arange(ids.shape[1])[None, :]
        # depth 0: every response position (labels outside the vocabulary are misses)
        response = (positions >= first_root) & (positions <= lengths - 2)
        hits += int(((predicted[0] == labels) & response).sum())
        scored_count += int(response.sum())
        # chains from roots r with EVAL_DEPTHS answer tokens after them
        width = ids.shape[1] - (EVAL_DEPTHS - 1)
        if width <= 0:
            continue
        root_ok = (positions[:, :width] >= first_root) & (
            positions[:, :width] + EVAL_DEPTHS - 1 <= lengths - 2
        )
        chain = root_ok
        for depth in range(EVAL_DEPTHS):
            right = predicted[depth][:, depth : depth + width] == labels[:, depth : depth + width]
            chain = chain & right
            chains[depth] += int(chain.sum())
        roots += int(root_ok.sum())
    accept = [float(c) / max(roots, 1) for c in chains]
    return EagleEval(
        tokens_per_verification=1.0 + sum(accept),
        top1=hits / max(scored_count, 1),
        accept_by_depth=accept,
    )


# ---- export -------------------------------------------------------------------------------
def export_eagle(
    model: EagleTrainModel,
    out_dir: Path,
    target_name: str,
    settings: EagleSettings,
    summary: dict,
    save_dtype: torch.dtype = torch.bfloat16,
) -> None:
    """draft.json ("method": "eagle"), config.json (the target's, one layer, untied) and
    model.safetensors (the trained tensors in ``save_dtype``, the draft vocabulary and
    the embedding probe), as engine/spec_decode/eagle.py loads them."""
    write_draft(
        out_dir,
        model.trained_state(),
        model.draft_vocab,
        model.embed,
        model.hf_config,
        target_name,
        {
            "method": METHOD,
            "aux_layers": list(model.aux_layers),
            "num_layers": 1,
            "settings": asdict(settings),
            **summary,
        },
        save_dtype,
    )
