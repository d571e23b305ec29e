"""EAGLE drafts: a one-layer draft that reads the target's own hidden states.

The contract shared by training (engine/train_draft/eagle.py) and serving (this module
and engine/spec_decode/eagle_proposer.py). Positions are the request's token positions;
``x_j`` is the token at position j, ``H`` the target's hidden size.

    g_j   the target's features at position j: the residual stream entering each of
          the aux layers (``aux_layers``, ascending; HF's ``hidden_states[l]``),
          concatenated [len(aux_layers) * H], at the target's dtype
    f_j   = fc(g_j)                                            [H]
    h_j   the hidden state the draft reads after position j: f_j where the target has
          computed position j ("target-featured"), the draft's own output o_j where it
          has not (a drafted position), and 0 for j = -1
    u_j   = in_proj(concat(embed_norm(E[x_j]), hidden_norm(h_{j-1})))          [H]
    o_j   the residual stream after one Llama decoder layer (the target's
          architecture: pre-norm attention and MLP, RoPE at position j) over u,
          causal over the positions before j
    logits_j = head(norm(o_j)), over the draft vocabulary: predicts x_{j+1}

``E`` is the target's embedding and ``head`` the target's LM-head rows for the draft
vocabulary (both frozen, neither stored with the draft). A draft directory holds
``draft.json`` (format specserve-draft, ``"method": "eagle"``, ``aux_layers``),
``config.json`` (the target's HF config with ``num_hidden_layers`` 1) and
``model.safetensors`` with: ``eagle.fc.weight`` [H, len(aux) * H],
``eagle.embed_norm.weight`` [H], ``eagle.hidden_norm.weight`` [H], ``eagle.in_proj.weight``
[H, 2H], the decoder layer as ``model.layers.0.*`` (HF names: q/k/v/o_proj with the
target's attention bias, gate/up/down_proj, input_layernorm, post_attention_layernorm),
``model.norm.weight``, ``specserve.draft_vocab`` (int64 ids the head scores) and
``specserve.embed_probe`` (16 embedding rows, as trained drafts carry). Loaded by
engine/spec_decode/trained_draft.py (load_draft), like the other trained drafts.

Serving, per request, with M verified tokens: the target's forward gives g for every
position it computes; the draft KV holds positions [0, n) all target-featured. A burst
feeds positions n .. M-1 (target features from g_{n-1} .. g_{M-2}; these are verified
tokens) and samples d_1 from logits_{M-1}; step s feeds d_{s-1} at position M+s-2 with
h = the draft's own output at the position before. After verification the draft cache
keeps positions [0, M) and rolls back the drafted ones, even accepted drafts: their
hidden input was the draft's own, and the next burst feeds them again with the
target's features (one more position per accepted draft, in the same forward).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.layers import RMSNorm
from engine.models.llama import LlamaModel
from engine.sample.sampler import expand_logits

METHOD = "eagle"


def default_aux_layers(num_layers: int) -> list[int]:
    """A low, a middle and a high layer, as EAGLE-3 reads them: for 30 layers 2, 15 and
    27; fewer on a tiny model (distinct, ascending, every one in [0, num_layers))."""
    if num_layers < 1:
        raise ValueError(f"the target needs at least one layer, got {num_layers}")
    picks = {min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)}
    return sorted(min(p, num_layers - 1) for p in picks)


def check_aux_layers(aux_layers: list[int], num_layers: int) -> list[int]:
    layers = [int(x) for x in aux_layers]
    if not layers or layers != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= num_layers:
        raise ValueError(
            f"aux layers must be distinct ascending layer indices in [0, {num_layers - 1}], "
            f"got {aux_layers}"
        )
    return layers


def is_eagle_meta(meta: dict) -> bool:
    return meta.get("method") == METHOD


class EagleDraftForCausalLM(nn.Module):
    """Serving form of the draft: ``forward(input_ids, positions, hidden_in)`` runs the
    paged decoder layer (batch layout from the attention metadata, like the target)
    and returns o [n, H]; ``compute_logits`` scatters the reduced head's logits into
    the full vocabulary (-inf elsewhere) so q is a distribution over the target's
    tokens, zero outside the draft vocabulary."""

    def __init__(self, config, attn_backend, draft_vocab: torch.Tensor, aux_layers) -> None:
        super().__init__()
        if config.num_layers != 1:
            raise ValueError(f"an EAGLE draft has one decoder layer, got {config.num_layers}")
        hidden = config.hidden_size
        self.config = config
        self.aux_layers = list(aux_layers)
        self.model = LlamaModel(config, attn_backend)
        self.eagle = nn.Module()
        self.eagle.fc = nn.Linear(len(self.aux_layers) * hidden, hidden, bias=False)
        self.eagle.embed_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.eagle.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.eagle.in_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.lm_head = nn.Linear(hidden, len(draft_vocab), bias=False)
        self.register_buffer("draft_vocab", draft_vocab.clone(), persistent=False)
        self.fc_params = self.eagle.fc.weight.numel()
        self.num_params = sum(p.numel() for p in self.parameters())
        # What a step reads: the embedding is a lookup of a few rows.
        self.num_streamed_params = self.num_params - self.model.embed_tokens.weight.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @torch.inference_mode()
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """g [n, len(aux) * H] -> f [n, H]."""
        return self.eagle.fc(features)

    def forward(
        self,
        input_ids: torch.Tensor,  # [n]
        positions: torch.Tensor,  # [n]
        hidden_in: torch.Tensor,  # [n, H]: h_{j-1} for each fed position j
    ) -> torch.Tensor:  # o [n, H]
        embeds = self.model.embed_tokens(input_ids)
        u = self.eagle.in_proj(
            torch.cat([self.eagle.embed_norm(embeds), self.eagle.hidden_norm(hidden_in)], dim=-1)
        )
        model = self.model
        rope = model.rotary.for_positions(positions, u.dtype)
        fused = model._run_fused(u.contiguous(), rope)
        if fused is None:
            fused = model.layers[0](u, None, rope)
        out, residual = fused
        return out + residual

    def compute_logits(self, o: torch.Tensor) -> torch.Tensor:
        return expand_logits(self.compute_reduced_logits(o), self.draft_vocab,
                             self.config.vocab_size)  # fmt: skip

    def compute_reduced_logits(self, o: torch.Tensor) -> torch.Tensor:
        """[n, draft vocab] in the model's dtype: column i scores token draft_vocab[i]."""
        return self.lm_head(self.model.norm(o.contiguous()))

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        from engine.models.llama import fused_decoder_for

        if len(kv_caches) != 1:
            raise ValueError(f"got {len(kv_caches)} KV caches for one layer")
        self.model.layers[0].self_attn.kv_cache = kv_caches[0]
        self.model.fused = fused_decoder_for(self.model, kv_caches)
