"""Every decoder layer of a Llama-family model in one call into cpu_kernels.c.

At batch 1 on CPU the Python around each layer's six kernel calls (module calls,
wrapper checks, views, the attention plan) cost about as much as the layer's own work:
~5 of 12 ms per token on the default model, because each layer's weight stream has
flushed the caches that Python's objects live in. ``specserve_decoder_layers_bf16`` (and
``specserve_decoder_layers`` in float32, ``specserve_decoder_layers_f32_bf16kv`` for a
float32 model over a bf16 KV cache) makes the same calls in the same order on the
same buffers, so the hidden states are bit-identical to the Python forward (tested),
and Python is left with the embedding; where the LM head is on the kernels too,
``FusedDecoderLayers.logits`` runs the final norm and the head in the same call.

Used by ``LlamaModel.forward`` when every piece of a layer runs on these kernels: a CPU
model whose every Linear is quantized (the quantized Linear kernel: any x86-64 level,
fp32 or bf16 activations) or packed for specserve's float Linear kernels (kernels built
with FMA, AVX2 and up; bf16 on vdpbf16ps or FMA, fp32 weights stored fp32 or bf16);
only qkv with a bias; the ``cpu`` attention backend with every query on the kernel; KV
caches bound. Where the float kernels are not built (a CPU without FMA) float Linear
layers stay layer by layer on oneDNN's GEMMs.
``SPECSERVE_FUSED_DECODER=0`` keeps the layer-by-layer Python forward (what
``specserve bench step`` times component by component).
"""

from __future__ import annotations

import ctypes

import torch

from engine.kernels.cpu import _F32, _I32, _I64, _P, CpuKernels, _check_index, check_sequences

_LAYER_FIELDS = (
    "input_norm", "qkv", "qkv_bias", "o", "post_norm", "gate_up", "down", "k_cache", "v_cache",
)  # fmt: skip


_FORMAT_FIELDS = ("qkv_fmt", "o_fmt", "gate_up_fmt", "down_fmt")
# A float Linear's weight formats (decoder_kernels.c); a quantized one's is its GGML id.
FLOAT_PACKED = 0  # packed for the Linear kernel of the model's dtype
BF16_STORED = 30  # a float32 model's weight stored as bf16 (GGML's BF16 id)


class _Layer(ctypes.Structure):  # struct specserve_layer
    _fields_ = [(name, _P) for name in _LAYER_FIELDS] + [(name, _I32) for name in _FORMAT_FIELDS]


class _Head(ctypes.Structure):  # struct specserve_head
    _fields_ = [
        ("norm", _P), ("weight", _P), ("fmt", _I32), ("vocab", _I64), ("rows", _P),
        ("num_rows", _I64), ("normed", _P), ("logits", _P), ("logits_f32", _P),
    ]  # fmt: skip


_ARGTYPES = [_P, _I64, _P, _P, _P, _P, _P, _P, _P, _I64]  # layers .. act, n
_ARGTYPES += [_I64, _I64, _I64, _I64, _I64, _F32]  # hidden .. inter, eps
_ARGTYPES += [_P, _P, _I64, _P, _I64, _I64]  # positions .. block_size
_ARGTYPES += [_P, _I64, _I64, _P, _P, _I64, _P, _I64, _I64, _F32, _I32]  # attention
_ARGTYPES += [_I32, _P, ctypes.POINTER(_Head)]  # continue_residual, tree_masks, head


class FusedDecoderLayers:
    """The layers of one model, their packed weights and bound KV caches as the C loop
    reads them. Holds references to every tensor it points at; rebuilt when the caches
    are bound again. Given the model's LM head (quantized, or packed for the Linear
    kernel of the model's dtype), ``logits`` runs the final norm and the head in the
    same call: at batch 1 their Python, and the second OpenMP region, cost 2-5% of a
    decode step (a Zen 4, 2026-12-07)."""

    def __init__(
        self, kernels: CpuKernels, model, kv_caches: list[torch.Tensor], lm_head=None
    ) -> None:
        config = model.config
        self.dtype = model.norm.weight.dtype
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"fused decoder: no kernels for {self.dtype}")
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim, self.hidden_size = config.head_dim, config.hidden_size
        self.inter = config.intermediate_size
        self.eps = float(config.rms_norm_eps)
        self.scale = config.head_dim**-0.5
        self.num_cache_blocks, self.block_size = kv_caches[0].shape[1], kv_caches[0].shape[2]
        # the model's dtype, or bf16 under a float32 model (--kv-cache-dtype bfloat16)
        self.kv_dtype = kv_caches[0].dtype
        if self.kv_dtype is not self.dtype and (self.dtype, self.kv_dtype) != (
            torch.float32,
            torch.bfloat16,
        ):
            raise ValueError(f"fused decoder: no kernels for a {self.kv_dtype} cache")
        self._keep: list[torch.Tensor] = []
        rows = []
        for layer, cache in zip(model.layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            qkv_bias = attn.qkv_proj.bias
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            (qkv, o, gate_up, down), formats = zip(*(self._weight(m) for m in linears))
            rows.append(
                _Layer(
                    self._ptr(layer.input_layernorm.weight),
                    qkv,
                    None if qkv_bias is None else self._ptr(qkv_bias),
                    o,
                    self._ptr(layer.post_attention_layernorm.weight),
                    gate_up,
                    down,
                    self._ptr(cache[0], self.kv_dtype),
                    self._ptr(cache[1], self.kv_dtype),
                    *formats,
                )
            )
        self.layers = (_Layer * len(rows))(*rows)
        self.num_layers = len(rows)
        name = "specserve_decoder_layers" + (
            "_bf16"
            if self.dtype is torch.bfloat16
            else "_f32_bf16kv"
            if self.kv_dtype is torch.bfloat16
            else ""
        )
        fn = getattr(kernels.lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, _ARGTYPES
        self._fn = fn
        # (final norm, head weight, its format, vocab) where the call runs the head
        self._head: tuple[int, int, int, int] | None = None
        if lm_head is not None:  # fused_decoder_for passes one on the kernels, no bias
            weight, fmt = self._weight(lm_head)
            self._head = (self._ptr(model.norm.weight), weight, fmt, lm_head.out_features)

    @property
    def has_head(self) -> bool:
        """Whether ``logits`` can run the final norm and the LM head in the call."""
        return self._head is not None

    def _weight(self, linear) -> tuple[int, int]:
        """(pointer, format) of a Linear's packed weight: FLOAT_PACKED for the Linear
        kernel of the model's dtype, BF16_STORED for a float32 model's bf16-stored
        weight, the GGML type id of a quantized one."""
        weight_q = getattr(linear, "weight_q", None)
        if weight_q is None:
            packed = linear.packed_weight
            if self.dtype is torch.float32 and packed.dtype is torch.bfloat16:
                return self._ptr(packed, torch.bfloat16), BF16_STORED
            return self._ptr(packed), FLOAT_PACKED
        data = weight_q.data
        if data.dtype is not torch.uint8 or not data.is_contiguous() or not data.is_cpu:
            raise ValueError("fused decoder: a quantized weight is not dense uint8 on the CPU")
        self._keep.append(data)
        return data.data_ptr(), weight_q.fmt

    def _ptr(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
        """The address of ``t``, dense on the CPU in ``dtype`` (default the model's), kept
        alive while the C loop may read it."""
        t, dtype = t.detach(), dtype or self.dtype
        if t.dtype is not dtype or not t.is_contiguous() or not t.is_cpu:
            raise ValueError(f"fused decoder: a {t.dtype} tensor is not dense {dtype} on the CPU")
        self._keep.append(t)
        return t.data_ptr()

    def __call__(
        self,
        hidden: torch.Tensor,  # [n, hidden_size] embeddings (the model's dtype), overwritten
        positions: torch.Tensor,  # [n] int64
        cos_sin: torch.Tensor,  # [max_positions, 2, head_dim // 2], the model's dtype
        metadata,  # AttentionMetadata of this step
        seq_ids: torch.Tensor,  # [num_selected] int32: every sequence (all on the kernel)
        max_query_len: int,
        capture_layers: tuple[int, ...] = (),
        captured: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (last MLP output, residual before it)
        """With ``capture_layers``, appends to ``captured`` the residual stream entering
        each of those layers [n, hidden_size] (an EAGLE draft's features): the layers
        run in segments between them, continuing the residual, so the result is what
        one call computes."""
        hidden, residual, _ = self._run(
            hidden, positions, cos_sin, metadata, seq_ids, max_query_len, capture_layers,
            captured, None,
        )  # fmt: skip
        return hidden, residual

    def logits(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        metadata,
        seq_ids: torch.Tensor,
        max_query_len: int,
        logit_rows: torch.Tensor | None,  # [rows] int64 increasing, or None: every row
        capture_layers: tuple[int, ...] = (),
        captured: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [rows, vocab] float32
        """What ``__call__`` computes, then the model's final norm of ``logit_rows`` and
        its LM head, in the same call (``has_head``): the bits of the model's norm and
        head run on ``__call__``'s output, widened to float32 (in the call, for a bf16
        model: exact, as ``.float()``)."""
        if self._head is None:
            raise ValueError("this one-call decoder was built without the LM head")
        if logit_rows is not None:
            _check_index("logit_rows", logit_rows, logit_rows.numel())
        return self._run(
            hidden, positions, cos_sin, metadata, seq_ids, max_query_len, capture_layers,
            captured, hidden.shape[0] if logit_rows is None else logit_rows,
        )[2]  # fmt: skip

    def _run(
        self, hidden, positions, cos_sin, metadata, seq_ids, max_query_len, capture_layers,
        captured, head_rows: torch.Tensor | int | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """head_rows: None (no head), the number of rows (all), or their indices."""
        n = hidden.shape[0]
        if hidden.dtype is not self.dtype or not hidden.is_contiguous():
            raise ValueError(f"hidden must be dense {self.dtype}")
        if hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden {tuple(hidden.shape)} must be [n, {self.hidden_size}]")
        if cos_sin.dtype is not self.dtype or not cos_sin.is_contiguous():
            raise ValueError(f"cos_sin must be dense {self.dtype}")
        if cos_sin.shape[1:] != (2, self.head_dim // 2):
            raise ValueError(
                f"cos_sin {tuple(cos_sin.shape)} does not fit head_dim {self.head_dim}"
            )
        _check_index("positions", positions, n)
        _check_index("slots", metadata.slot_mapping, n)
        tables = metadata.block_tables
        num_seqs = check_sequences(tables, metadata.seq_lens, metadata.query_start_loc, seq_ids)
        q_size = self.num_heads * self.head_dim
        qkv_size = q_size + 2 * self.num_kv_heads * self.head_dim
        residual = torch.empty_like(hidden)
        normed = torch.empty_like(hidden)
        qkv = hidden.new_empty(n, qkv_size)
        attn = hidden.new_empty(n, q_size)
        gate_up = hidden.new_empty(n, 2 * self.inter)
        act = hidden.new_empty(n, self.inter)
        group = self.num_heads // self.num_kv_heads
        bounds = [layer for layer in capture_layers if 0 < layer < self.num_layers]
        if 0 in capture_layers and captured is not None:
            captured.append(hidden.clone())
        head, logits = None, None
        if head_rows is not None:
            norm, weight, fmt, vocab = self._head
            rows = head_rows if isinstance(head_rows, int) else head_rows.shape[0]
            logits = torch.empty(rows, vocab, dtype=torch.float32)
            head_normed = hidden.new_empty(rows, self.hidden_size)
            # a bf16 model's head writes bf16 (scratch) and the call widens it into logits
            out = hidden.new_empty(rows, vocab) if self.dtype is torch.bfloat16 else logits
            head = _Head(
                norm, weight, fmt, vocab,
                None if isinstance(head_rows, int) else head_rows.data_ptr(), rows,
                head_normed.data_ptr(), out.data_ptr(),
                logits.data_ptr() if self.dtype is torch.bfloat16 else None,
            )  # fmt: skip
        start = 0
        for end in [*bounds, self.num_layers]:
            if end <= start:
                continue
            self._run_layers(
                start, end, hidden, residual, normed, qkv, attn, gate_up, act, positions,
                cos_sin, metadata, seq_ids, num_seqs, max(max_query_len * group, 1),
                head if end == self.num_layers else None,
            )  # fmt: skip
            if end < self.num_layers and captured is not None:
                captured.append(hidden + residual)
            start = end
        return hidden, residual, logits

    def _run_layers(
        self, start, end, hidden, residual, normed, qkv, attn, gate_up, act, positions,
        cos_sin, metadata, seq_ids, num_seqs, max_rows, head,
    ) -> None:  # fmt: skip
        n = hidden.shape[0]
        tables = metadata.block_tables
        status = self._fn(
            ctypes.addressof(self.layers) + start * ctypes.sizeof(_Layer), end - start,
            hidden.data_ptr(), residual.data_ptr(),
            normed.data_ptr(), qkv.data_ptr(), attn.data_ptr(), gate_up.data_ptr(),
            act.data_ptr(), n, self.hidden_size, self.num_heads, self.num_kv_heads,
            self.head_dim, self.inter, self.eps, positions.data_ptr(), cos_sin.data_ptr(),
            cos_sin.shape[0], metadata.slot_mapping.data_ptr(), self.num_cache_blocks,
            self.block_size, tables.data_ptr(), tables.stride(0), tables.shape[1],
            metadata.seq_lens.data_ptr(), metadata.query_start_loc.data_ptr(), num_seqs,
            seq_ids.data_ptr(), seq_ids.shape[0], max_rows, self.scale,
            torch.get_num_threads(), int(start > 0),
            None if metadata.tree_masks is None else metadata.tree_masks.data_ptr(),
            None if head is None else ctypes.byref(head),
        )  # fmt: skip
        if status:
            raise _error(status, cos_sin.shape[0], self.num_cache_blocks * self.block_size)


def _error(status: int, num_positions: int, num_slots: int) -> Exception:
    if status == 1:
        return ValueError(f"a position is outside the rotary table's 0..{num_positions - 1}")
    if status == 2:
        return ValueError(f"a slot in slot_mapping is past the cache's {num_slots} slots")
    if status == 3:
        return MemoryError("a quantized Linear could not allocate its scratch buffers")
    if status == 4:
        return ValueError("logit_rows must be increasing rows of the step, each once")
    if status == 11:
        return MemoryError("paged attention could not allocate its scratch buffers")
    if status == 12:
        return ValueError("a selected sequence has more query tokens than max_query_len")
    return ValueError(
        "a block id outside the cache, a sequence id outside seq_lens, or lengths that do "
        "not fit the block table or the query"
    )
