"""Tiny random Llama-family checkpoints for tests, saved like real HF models.

    path = make_tiny_model(tmp_path / "llama")                 # GQA Llama, untied
    path = make_tiny_model(tmp_path / "qwen", arch="qwen2")    # q/k/v biases
    path = make_tiny_model(tmp_path / "m", arch="mistral", tie_word_embeddings=True)

Each directory holds config.json, model.safetensors, generation_config.json and a
byte-level tokenizer (every byte is one token, so decode(encode(text)) == text for any
ASCII text) with a ChatML chat template. Weights are seeded: the same call gives the
same model. In tests, prefer the ``tiny_model_dir`` / ``tiny_model_factory`` fixtures.
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
BOS_ID, EOS_ID = 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_BASE = dict(
    vocab_size=259,  # 3 special tokens + 256 bytes: every id decodes
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: two query heads per KV head
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=0,
)


def _config(arch: str, overrides: dict):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}
    if arch not in classes:
        raise ValueError(f"arch must be one of {sorted(classes)}, got {arch!r}")
    return classes[arch](**{**_BASE, **overrides})


def make_tokenizer():
    """Byte-level tokenizer: ids 0-2 are special tokens, then one id per byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],
        pad_token=SPECIAL_TOKENS[0],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_model(
    path: str | Path, arch: str = "llama", seed: int = 0, **config_overrides
) -> str:
    """Save a random ``arch`` ("llama", "mistral", "qwen2") model + tokenizer at ``path``.

    ``config_overrides`` go to the transformers config (e.g. ``num_hidden_layers=4``,
    ``tie_word_embeddings=True``, ``rope_scaling={...}``). Returns ``str(path)``.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = _config(arch, config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF's init is tiny (std 0.02): widen it so logits differ clearly
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.1)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=0
    )
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)
    return str(path)


def _permute_for_gguf(weight, num_heads: int):
    # llama.cpp's convert script reorders Q/K rows from HF's rotate-half layout to
    # interleaved pairs; readers (transformers' GGUF loader) must undo exactly this.
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    parts = hf_name.split(".")  # model.layers.<i>.<module...>.weight
    return f"blk.{parts[2]}.{_GGUF_NAMES['.'.join(parts[3:-1])]}.weight"


def write_tiny_gguf(
    hf_dir: str | Path, gguf_path: str | Path, linear: str = "F32", embedding: str = "F32"
) -> str:
    """Write the tiny *llama* model at ``hf_dir`` as a .gguf, the llama.cpp way: its
    Linear weights (and the head) in type ``linear``, the embedding in ``embedding``
    ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", ...), norms in F32."""
    import json

    import gguf
    import numpy as np
    from safetensors.torch import load_file

    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    writer = gguf.GGUFWriter(str(gguf_path), "llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_file_type(0 if linear == "F32" else 1 if linear == "F16" else 7)
    vocab = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS)))
    writer.add_token_merges([])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_pad_token_id(0)
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        array = tensor.float().numpy()
        proj = name.split(".")[-2]
        if proj in heads:
            array = _permute_for_gguf(array, heads[proj])
        kind = "F32" if array.ndim == 1 else embedding if "embed_tokens" in name else linear
        if kind == "F32":
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(array))
        elif kind == "F16":
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(array.astype(np.float16)))
        else:
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            data = gguf.quants.quantize(np.ascontiguousarray(array), qtype)
            writer.add_tensor(_gguf_name(name), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(gguf_path)


def make_truncated_draft(target_dir: str | Path, path: str | Path, num_layers: int = 1) -> str:
    """A draft model made of the target's first ``num_layers`` layers (plus its
    embeddings, final norm and head) and the target's tokenizer."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    config = AutoConfig.from_pretrained(target_dir)
    config.num_hidden_layers = num_layers
    draft = AutoModelForCausalLM.from_config(config)
    missing = draft.load_state_dict(target.state_dict(), strict=False).missing_keys
    if missing:
        raise RuntimeError(f"truncated draft is missing weights: {missing}")
    draft.save_pretrained(path)
    for name in Path(target_dir).iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(name, Path(path) / name.name)
    return str(path)
