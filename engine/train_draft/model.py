"""The draft as it is trained: a shallow copy of the target's own architecture.

    embed_tokens   the target's, frozen (and shared with the target when served)
    layers         L decoder layers, initialized from the target's first L
    norm           initialized from the target's final norm
    head           the target's LM-head rows for the draft vocabulary (the response
                   tokens seen most often in the data), frozen

Built with transformers' class for the target's architecture, so the trained weights
carry HF names that the serving loader (engine/spec_decode/trained_draft.py) reads into
specserve's own model. Only the layers and the norm are trained and saved: a few MB.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.loader import iter_safetensors, read_json


def layer_sources(num_target_layers: int, num_layers: int) -> list[int]:
    """Which target layer initializes each draft layer: the first ``num_layers`` (the
    draft starts as the target exiting early). On SmolLM2-135M after 30 steps, 2 layers
    from [0, 1] agreed with the target on 17.3% of held-out tokens, from [0, 29] on
    14.6%; 4 layers from [0..3] on 19.9%."""
    if num_layers > num_target_layers:
        raise ValueError(
            f"--num-layers must be at most the target's {num_target_layers} layers, "
            f"got {num_layers}"
        )
    return list(range(num_layers))


def draft_hf_config(target_config: dict, num_layers: int) -> dict:
    config = dict(target_config)
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:num_layers]
    if "max_window_layers" in config:
        config["max_window_layers"] = min(config["max_window_layers"], num_layers)
    config["tie_word_embeddings"] = False  # the head is the target's rows, not the embedding
    config.pop("torch_dtype", None)
    config.pop("dtype", None)
    return config


def choose_vocab(sequences, vocab_size: int, size: int, always: set[int]) -> np.ndarray:
    """The ``size`` token ids most frequent in the responses (plus ``always``), sorted."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for seq in sequences:
        np.add.at(counts, seq.token_ids[seq.prompt_len :], 1)
    order = np.argsort(-counts, kind="stable")
    keep = [int(t) for t in always if 0 <= t < vocab_size]
    chosen = set(keep)
    for token in order:
        if len(chosen) >= size:
            break
        chosen.add(int(token))
    return np.asarray(sorted(chosen), dtype=np.int64)


class DraftLM(nn.Module):
    def __init__(
        self,
        target_dir: Path,
        num_layers: int,
        draft_vocab: np.ndarray,
        layers_from: list[int] | None = None,
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        super().__init__()
        target_config = read_json(target_dir / "config.json")
        self.hf_config = draft_hf_config(target_config, num_layers)
        config = AutoConfig.for_model(**self.hf_config)
        config._attn_implementation = "sdpa"
        full = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        self.model = full.model  # embed_tokens, layers, norm, rotary_emb
        self.layers_from = layers_from or layer_sources(
            target_config["num_hidden_layers"], num_layers
        )
        weights = dict(iter_safetensors(target_dir, torch.device("cpu")))
        head_name = "lm_head.weight"
        if head_name not in weights or target_config.get("tie_word_embeddings", False):
            head_name = "model.embed_tokens.weight"
        self.register_buffer("draft_vocab", torch.as_tensor(draft_vocab), persistent=False)
        self.register_buffer(
            "head", weights[head_name].float()[self.draft_vocab].contiguous(), persistent=False
        )
        self._init_from_target(weights)
        self.model.embed_tokens.weight.requires_grad_(False)

    @torch.no_grad()
    def _init_from_target(self, weights: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        for name in own:
            source = f"model.{name}"
            if name.startswith("layers."):
                index, rest = name.split(".", 2)[1:]
                source = f"model.layers.{self.layers_from[int(index)]}.{rest}"
            if source in weights:
                own[name].copy_(weights[source].float())
            elif not name.endswith("inv_freq"):
                raise ValueError(f"target checkpoint has no {source!r} to initialize {name!r}")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, T] -> logits over the draft vocabulary [B, T, N]."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return hidden @ self.head.to(hidden.dtype).t()

    def trained_state(self) -> dict[str, torch.Tensor]:
        """HF-named tensors of everything trained (layers and final norm)."""
        return {
            f"model.{name}": p.detach()
            for name, p in self.model.named_parameters()
            if p.requires_grad
        }
