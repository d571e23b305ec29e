"""A GGUF file's tensors under Hugging Face names, quantized ones as stored.

llama.cpp names (``blk.N.attn_q.weight``) map onto HF names
(``model.layers.N.self_attn.q_proj.weight``); the Q and K rows of a "llama" file are
put back in HF's order (llama.cpp interleaves each head's rotary halves; a row
permutation, so a quantized row moves whole). Q4_0, Q4_1 and Q8_0 tensors come out as
``QuantizedTensor`` (their GGUF rows, memory-mapped) when asked to keep them; every
other type, and all of them otherwise, is dequantized to float32.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.default_model import ModelLoadError
from engine.kernels.quant import FORMATS

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_FLOAT_TYPES = {"F32", "F16", "BF16"}


@dataclass(frozen=True)
class QuantizedTensor:
    """A GGUF tensor served as stored: its rows, each row's 32-weight blocks in order."""

    format: str  # "Q4_0", "Q4_1" or "Q8_0"
    rows: torch.Tensor  # uint8 [n, k / 32 * block bytes]
    shape: tuple[int, int]  # (n, k): out and in features

    @property
    def fmt(self) -> int:
        return FORMATS[self.format]

    def dequantize(self) -> torch.Tensor:  # [n, k] float32
        import gguf

        kind = getattr(gguf.GGMLQuantizationType, self.format)
        return torch.from_numpy(gguf.quants.dequantize(self.rows.numpy(), kind))


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a llama.cpp tensor name; None for one the model has no use for."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def read_gguf_tensors(
    path: Path, num_heads: int, num_kv_heads: int, keep_quantized: bool
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """(HF name, tensor) for every tensor of ``path`` the model uses. One log line names
    the tensor types that were dequantized, and why."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        arch = _architecture(reader)
    except Exception as exc:  # noqa: BLE001 - a bad file becomes one line for the user
        raise ModelLoadError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None
    dequantized: dict[str, int] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        kind = tensor.tensor_type.name
        value = _tensor(tensor, kind, keep_quantized)
        if kind not in _FLOAT_TYPES and not isinstance(value, QuantizedTensor):
            dequantized[kind] = dequantized.get(kind, 0) + 1
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            value = _unpermute(value, num_heads if ".q_proj." in name else num_kv_heads)
        yield name, value
    if dequantized:
        why = "--quantization none" if not keep_quantized else "no kernel serves them as stored"
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(dequantized.items()))
        logger.info("%s: dequantized %s tensors (%s)", path.name, kinds, why)


def _architecture(reader) -> str:
    field = reader.get_field("general.architecture")
    if field is None:
        raise ValueError("no general.architecture in its metadata")
    return bytes(field.parts[field.data[0]]).decode()


def _tensor(tensor, kind: str, keep_quantized: bool) -> torch.Tensor | QuantizedTensor:
    import gguf

    data = tensor.data
    if kind in _FLOAT_TYPES:
        array = np.asarray(data)
        if kind == "BF16":  # numpy has no bfloat16: gguf hands out the raw uint16 words
            return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16).float()
        return torch.from_numpy(array.astype(np.float32))
    n = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
    k = int(tensor.shape[0])
    if kind in FORMATS and keep_quantized:
        rows = torch.from_numpy(np.array(data, dtype=np.uint8).reshape(n, -1))  # a copy: writable
        return QuantizedTensor(kind, rows, (n, k))
    array = gguf.quants.dequantize(np.asarray(data), tensor.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).reshape(n, k)


def _unpermute(value, num_heads: int):
    """llama.cpp's Q/K row order back to HF's: each head's rows [r0, r1, r2, r3 ...]
    were stored as [r0, r(d/2), r1, r(d/2 + 1) ...]."""
    if isinstance(value, QuantizedTensor):
        return QuantizedTensor(value.format, _unpermute_rows(value.rows, num_heads), value.shape)
    return _unpermute_rows(value, num_heads)


def _unpermute_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    n = rows.shape[0]
    half = n // num_heads // 2
    return rows.reshape(num_heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)
