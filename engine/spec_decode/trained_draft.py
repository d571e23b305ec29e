"""Serve a draft made by ``specserve train-draft`` (a directory with draft.json).

The directory holds only what was trained: L decoder layers and a final norm in HF
names, the draft vocabulary (token ids its head scores) and 16 rows of the embedding
it was trained with. The rest comes from the loaded target: the embedding is the
target's own (shared, not copied; a quantized one too) and the head is the target's
LM-head rows for the draft vocabulary (dequantized from a quantized head). Logits over
the draft vocabulary are scattered into the full vocabulary with -inf elsewhere, so
draft probabilities are a distribution over the target's tokens as rejection sampling
needs, zero outside the draft vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine.default_model import ModelLoadError
from engine.models.llama import LlamaForCausalLM
from engine.sample.sampler import expand_logits

DRAFT_FILE = "draft.json"
FORMAT = "specserve-draft"
FORMAT_VERSION = 1
_OWN_TENSORS = ("specserve.draft_vocab", "specserve.embed_probe")


def embed_probe_ids(vocab_size: int) -> torch.Tensor:
    """16 embedding rows spread over the vocabulary: enough to tell one target from another."""
    return torch.linspace(0, vocab_size - 1, 16).round().long().unique()


def is_trained_draft(path: str | Path | None) -> bool:
    return path is not None and (Path(path).expanduser() / DRAFT_FILE).is_file()


class TrainedDraftForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose head scores ``draft_vocab`` only."""

    def __init__(self, config, attn_backend, draft_vocab: torch.Tensor) -> None:
        super().__init__(config, attn_backend)
        self.lm_head = nn.Linear(config.hidden_size, len(draft_vocab), bias=False)
        self.register_buffer("draft_vocab", draft_vocab.clone(), persistent=False)
        self.num_params = sum(p.numel() for p in self.parameters())
        # What a step reads: the embedding is a lookup of a few rows.
        self.num_streamed_params = self.num_params - self.model.embed_tokens.weight.numel()

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return expand_logits(self.compute_reduced_logits(hidden_states), self.draft_vocab,
                             self.config.vocab_size)  # fmt: skip

    def compute_reduced_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, draft vocab] in the model's dtype: column i scores token draft_vocab[i]."""
        return self.lm_head(hidden_states)


def load_draft(path: str, target, attn_backend: str = "auto", quantization: str = "auto"):
    """The draft model for ``target``: a train-draft directory, or any model path or hub
    id load_model accepts (a standalone model sharing the target's tokenizer, loaded with
    ``quantization``)."""
    if is_trained_draft(path):
        return load_trained_draft(path, target, attn_backend)
    from engine.loader import load_model

    return load_model(
        path,
        dtype=str(target.dtype).removeprefix("torch."),
        device=str(target.device),
        attn_backend=attn_backend,
        quantization=quantization,
    )


def load_trained_draft(path: str | Path, target, attn_backend: str = "auto"):
    """LoadedModel of the draft in ``path`` (either train-draft method) for the loaded
    ``target``; ModelLoadError in one line when it is not a draft for this target."""
    from engine.attention import get_attention_backend
    from engine.loader import LoadedModel, read_json, resolve_attn_backend
    from engine.model_config import ModelArchConfig
    from engine.models.weights import load_hf_weights
    from engine.spec_decode.eagle import is_eagle_meta

    directory = Path(path).expanduser()
    meta = read_json(directory / DRAFT_FILE)
    if meta.get("format") != FORMAT:
        raise ModelLoadError(
            f"{directory}/{DRAFT_FILE}: not a specserve draft (format {meta.get('format')!r})"
        )
    arch = ModelArchConfig.from_hf_config(read_json(directory / "config.json"))
    weights = _read_weights(directory)
    draft_vocab = weights.pop("specserve.draft_vocab").long()
    probe = weights.pop("specserve.embed_probe")
    _check_target(directory, meta, arch, target, probe)
    if is_eagle_meta(meta):
        make = _eagle_maker(directory, meta, arch, target, weights, draft_vocab)
    else:
        make = lambda backend: TrainedDraftForCausalLM(arch, backend, draft_vocab)  # noqa: E731
    device, dtype = torch.device(target.device), target.dtype
    backend = get_attention_backend(resolve_attn_backend(attn_backend, device, dtype), device)
    with torch.device("meta"):
        model = make(backend)
    model = model.to(dtype).to_empty(device=device)
    model.draft_vocab = draft_vocab.to(device)
    model.model.embed_tokens = target.model.model.embed_tokens  # shared: no second copy
    head_rows = _target_head_rows(target, draft_vocab)
    try:
        load_hf_weights(
            model, [*weights.items(), ("lm_head.weight", head_rows)], ["model.embed_tokens.weight"]
        )
    except ValueError as e:
        raise ModelLoadError(f"draft {directory}: {e}") from None
    return LoadedModel(
        model.eval(),
        target.tokenizer,
        arch,
        str(directory.resolve()),
        dtype,
        device,
        set(target.eos_token_ids),
        directory,
    )


def _eagle_maker(directory: Path, meta: dict, arch, target, weights: dict, draft_vocab):
    """The constructor of an EAGLE draft (eagle.py) once its layers fit ``target``."""
    from engine.spec_decode.eagle import EagleDraftForCausalLM, check_aux_layers

    try:
        aux = check_aux_layers(meta.get("aux_layers") or [], target.arch.num_layers)
    except ValueError as e:
        raise ModelLoadError(
            f"draft {directory}: {e} (the target has {target.arch.num_layers} layers)"
        ) from None
    fc = weights.get("eagle.fc.weight")
    if fc is None or fc.shape[1] != len(aux) * arch.hidden_size:
        raise ModelLoadError(f"draft {directory}: eagle.fc.weight does not read {len(aux)} layers")
    return lambda backend: EagleDraftForCausalLM(arch, backend, draft_vocab, aux)


def _check_target(directory: Path, meta: dict, arch, target, probe: torch.Tensor) -> None:
    hint = f"train one for it with: specserve train-draft --model {_model_flag(target)} --out DIR"
    if arch.vocab_size != target.arch.vocab_size or arch.hidden_size != target.arch.hidden_size:
        raise ModelLoadError(
            f"draft {directory} was made for {meta.get('target')!r} (vocabulary "
            f"{arch.vocab_size}, hidden size {arch.hidden_size}), not for {target.name!r} "
            f"({target.arch.vocab_size}, {target.arch.hidden_size}); {hint}"
        )
    rows = target.model.embedding_rows(embed_probe_ids(arch.vocab_size)).float().cpu()
    if rows.shape != probe.shape or not torch.allclose(rows, probe, rtol=2e-2, atol=2e-3):
        raise ModelLoadError(
            f"draft {directory} was made for {meta.get('target')!r}, whose embedding differs "
            f"from {target.name!r}'s; {hint}"
        )


def _model_flag(target) -> str:
    from engine.default_model import DEFAULT_MODEL_NAME

    return "(default)" if target.name == DEFAULT_MODEL_NAME else target.name


def _target_head_rows(target, ids: torch.Tensor) -> torch.Tensor:
    """The target's LM-head rows ``ids`` [len(ids), hidden] (a float head packed for the
    CPU GEMM keeps no plain weight: it is read back from the checkpoint)."""
    rows = target.model.head_rows(ids)
    if rows is not None:
        return rows
    if target.model_dir is None:
        raise ModelLoadError(f"cannot read {target.name!r}'s LM head for the draft")
    from safetensors import safe_open

    for file in sorted(Path(target.model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device=str(target.device)) as f:
            if "lm_head.weight" in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                return f.get_tensor("lm_head.weight").to(target.dtype)[ids]
    raise ModelLoadError(f"{target.model_dir}: no lm_head.weight for the draft's head")


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = directory / "model.safetensors"
    if not path.is_file():
        raise ModelLoadError(f"{directory}: no model.safetensors")
    weights = load_file(str(path))
    missing = [name for name in _OWN_TENSORS if name not in weights]
    if missing:
        raise ModelLoadError(f"{path}: not a specserve draft (no {', '.join(missing)})")
    return weights
