"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

q/k/v and gate/up projections are fused into single matmuls (fewer, larger GEMMs matter
on CPU); ``load_weights`` splits HF checkpoints' separate tensors into the fused ones.
The batch layout comes from ``get_attention_metadata()``; ``forward`` only sees a packed
``[num_tokens]`` stream of token ids and their positions.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine import envs
from engine.attention.metadata import get_attention_metadata
from engine.kernels.cpu import kernels_for
from engine.kernels.decoder import FusedDecoderLayers
from engine.model_config import ModelArchConfig
from engine.models.layers import RMSNorm, RopeBatch, RotaryEmbedding, silu_and_mul


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelArchConfig, attn_backend) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.attn_backend = attn_backend
        self.kv_cache: torch.Tensor | None = None  # set by bind_kv_caches

    def forward(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        rope: RopeBatch,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, q_size + 2 * kv_size]
        q, k = rope(qkv, self.num_heads, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, -1)
        if self.kv_cache is None:
            raise RuntimeError("KV caches are not bound: call model.bind_kv_caches() first")
        out = self.attn_backend.forward(q, k, v, self.kv_cache, self.scale)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size]
        return self.down_proj(silu_and_mul(gate_up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, attn_backend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, attn_backend)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None, rope: RopeBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before adding it): the
        add is fused into the next norm, ``x + f(norm(x))`` in the same order as HF."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, rope)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelArchConfig, attn_backend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attn_backend) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.config = config
        self.fused: FusedDecoderLayers | None = None  # set by bind_kv_caches where it runs
        # An EAGLE draft's features: the residual stream entering these layers, kept
        # after each forward as ``captured`` [num_tokens, len(capture_layers) * hidden].
        self.capture_layers: tuple[int, ...] = ()
        self.captured: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.run(input_ids, positions)[0]

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        head: bool = False,
        logit_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, bool]:
        """(out, is_logits): the final norm's output [num_tokens, hidden_size]; or, with
        ``head`` where the one-call decoder runs this step and holds the LM head, the
        head's output for ``logit_rows`` (every row when None) [rows, vocab], computed
        in the same call and widened there to float32."""
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        rope = self.rotary.for_positions(positions, hidden_states.dtype)  # shared by all layers
        captured: list[torch.Tensor] | None = [] if self.capture_layers else None
        head = head and self.fused is not None and self.fused.has_head
        fused = self._run_fused(hidden_states, rope, captured, head, logit_rows)
        if isinstance(fused, torch.Tensor):
            if captured is not None:
                self.captured = torch.cat(captured, dim=-1)
            return fused, True
        if fused is not None:
            out = self.norm(*fused)[0]
        else:
            residual = None
            for i, layer in enumerate(self.layers):
                if captured is not None and i in self.capture_layers:
                    # a copy: the first layer's residual is the embedding, added to in place
                    entering = (
                        hidden_states.clone() if residual is None else hidden_states + residual
                    )
                    captured.append(entering)
                hidden_states, residual = layer(hidden_states, residual, rope)
            out = self.norm(hidden_states, residual)[0]
        if captured is not None:
            self.captured = torch.cat(captured, dim=-1)
        return out, False

    def _run_fused(
        self,
        hidden_states: torch.Tensor,
        rope: RopeBatch,
        captured: list[torch.Tensor] | None = None,
        head: bool = False,
        logit_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None:
        """Every layer in one kernel call (engine/kernels/decoder.py), when this step's
        attention runs on the kernel for every query and rotary on the kernel too: the
        last layer's (MLP output, residual), or, with ``head``, the LM head's logits of
        ``logit_rows`` (None: all) after the final norm, in the same call."""
        if self.fused is None or rope.cos is not None or hidden_states.shape[0] == 0:
            return None
        metadata = get_attention_metadata()
        plan = self.layers[0].self_attn.attn_backend.kernel_plan(metadata, hidden_states.dtype)
        if plan is None:
            return None
        seq_ids, max_query_len = plan
        capture = self.capture_layers if captured is not None else ()
        if head:
            return self.fused.logits(
                hidden_states, rope.positions, rope.table, metadata, seq_ids, max_query_len,
                logit_rows, capture, captured,
            )  # fmt: skip
        return self.fused(
            hidden_states, rope.positions, rope.table, metadata, seq_ids, max_query_len,
            capture, captured,
        )  # fmt: skip


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelArchConfig, attn_backend) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, attn_backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Counted before CPU weight packing turns Linear weights into non-parameters.
        self.num_params = sum(p.numel() for p in self.parameters())
        # What one step reads: an untied embedding is a lookup of a few rows.
        embedding = self.model.embed_tokens.weight.numel()
        self.num_streamed_params = self.num_params - (
            0 if config.tie_word_embeddings else embedding
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        """Run one packed step; the batch layout is read from get_attention_metadata()."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32."""
        return self.lm_head(hidden_states).float()

    def logits(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        logit_rows: torch.Tensor | None,  # [rows] int64 increasing; None: every row
    ) -> torch.Tensor:  # [rows, vocab_size] float32
        """``compute_logits(forward(...)[logit_rows])``; where the one-call decoder runs
        the step, its call runs the final norm and the head too (the same bits)."""
        out, is_logits = self.model.run(input_ids, positions, True, logit_rows)
        if is_logits:
            return out
        if logit_rows is not None:
            out = out[logit_rows]
        return self.compute_logits(out)

    @torch.no_grad()
    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the input embedding [len(ids), hidden] in the model's dtype,
        dequantized when the embedding is quantized. ``ids`` may be on the CPU."""
        return self.model.embed_tokens(ids.to(self.model.norm.weight.device))

    @torch.no_grad()
    def head_rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Rows ``ids`` of the LM head's weight [len(ids), hidden], or None when the model
        keeps no copy it can read (a float head packed for the CPU GEMM)."""
        ids = ids.to(self.model.norm.weight.device)
        if self.config.tie_word_embeddings:
            return self.embedding_rows(ids)
        head = self.lm_head
        if isinstance(getattr(head, "weight", None), torch.Tensor):
            return head.weight.detach()[ids]
        if hasattr(head, "weight_q"):  # a quantized head: its rows, dequantized
            return head.ops.embed(ids, head.weight_q, self.model.norm.weight.dtype)
        return None

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Give layer i its cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]``."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.model.layers)} layers")
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            layer.self_attn.kv_cache = cache
        # the head joins the call only where compute_logits is this class's (a trained
        # draft's scatters a reduced head's logits)
        own_head = type(self).compute_logits is LlamaForCausalLM.compute_logits
        self.model.fused = fused_decoder_for(
            self.model, kv_caches, self.lm_head if own_head else None
        )

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; raises on anything missing."""
        from engine.models.weights import load_hf_weights

        load_hf_weights(self, weights)


def fused_decoder_for(
    model: LlamaModel, kv_caches: list[torch.Tensor], lm_head: nn.Module | None = None
) -> FusedDecoderLayers | None:
    """The one-call decoder for ``model`` when every piece of its layers runs on the
    kernels (engine/kernels/decoder.py: quantized Linear layers, or float ones on the
    Linear kernel of the model's dtype), else None: the layer-by-layer forward. With
    ``lm_head`` on the kernels too (and no bias), the call can run it."""
    from engine.attention.cpu_backend import CpuAttentionBackend

    weight = model.norm.weight
    kernels = kernels_for(weight.device, weight.dtype)
    dtypes = (torch.bfloat16, torch.float32)
    if not envs.fused_decoder() or weight.dtype not in dtypes or kernels is None:
        return None
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(_on_the_kernels(m) for m in linears):
            return None
        if any(m.bias is not None for m in linears[1:]):
            return None
        if not isinstance(attn.attn_backend, CpuAttentionBackend):
            return None
    if lm_head is not None and (not _on_the_kernels(lm_head) or lm_head.bias is not None):
        lm_head = None
    try:
        return FusedDecoderLayers(kernels, model, kv_caches, lm_head)
    except ValueError:  # a tensor not dense in the model's dtype: layer by layer copes
        return None


def _on_the_kernels(linear: nn.Module) -> bool:
    """A Linear the one-call decoder runs: quantized, or packed for specserve's Linear
    kernel of the model's dtype."""
    from engine.models.quant import QuantizedLinear
    from engine.models.weights import PackedLinear

    if isinstance(linear, QuantizedLinear):
        return True
    return isinstance(linear, PackedLinear) and linear.kernels is not None
