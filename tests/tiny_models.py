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
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    unit_rms_embeddings: bool = False,
    checkpoint_dtype: torch.dtype = torch.float32,
    **config_overrides,
) -> str:
    """Save a random ``arch`` ("llama", "mistral", "qwen2") model + tokenizer at ``path``.

    ``config_overrides`` go to the transformers config (e.g. ``num_hidden_layers=4``,
    ``tie_word_embeddings=True``, ``rope_scaling={...}``). ``unit_rms_embeddings``: every
    embedding row scaled to RMS 1 (an RMSNorm with weight 1 leaves it as it is; see
    make_exact_eagle_draft). ``checkpoint_dtype``: the dtype saved (bfloat16: a checkpoint
    as most are published). Returns ``str(path)``.
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
        if unit_rms_embeddings:
            embed = model.get_input_embeddings().weight
            embed /= embed.pow(2).mean(-1, keepdim=True).sqrt()
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=0
    )
    path = Path(path)
    model.to(checkpoint_dtype).save_pretrained(path, safe_serialization=True)
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


def make_random_eagle_draft(
    target_dir: str | Path, path: str | Path, vocab: int | None = None, seed: int = 0
) -> str:
    """An EAGLE draft (engine/spec_decode/eagle.py's format) for the target with random
    weights: loads and runs like a trained one, drafts badly. ``vocab``: score only the
    first ``vocab`` token ids (default: all)."""
    import json

    from safetensors.torch import save_file

    from engine.spec_decode.eagle import default_aux_layers
    from engine.spec_decode.trained_draft import embed_probe_ids

    config = json.loads((Path(target_dir) / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    aux = default_aux_layers(config["num_hidden_layers"])
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.1

    layer = "model.layers.0."
    tensors = {
        "eagle.fc.weight": rand(hidden, len(aux) * hidden),
        "eagle.embed_norm.weight": torch.ones(hidden),
        "eagle.hidden_norm.weight": torch.ones(hidden),
        "eagle.in_proj.weight": rand(hidden, 2 * hidden),
        layer + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
        layer + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
        layer + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
        layer + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        layer + "mlp.gate_proj.weight": rand(inter, hidden),
        layer + "mlp.up_proj.weight": rand(inter, hidden),
        layer + "mlp.down_proj.weight": rand(hidden, inter),
        layer + "input_layernorm.weight": torch.ones(hidden),
        layer + "post_attention_layernorm.weight": torch.ones(hidden),
        "model.norm.weight": torch.ones(hidden),
    }
    if config.get("attention_bias") or config.get("model_type") == "qwen2":
        for name, size in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            tensors[f"{layer}self_attn.{name}_proj.bias"] = rand(size * head_dim)
    vocab_size = config["vocab_size"]
    tensors["specserve.draft_vocab"] = torch.arange(vocab or vocab_size, dtype=torch.int64)
    from safetensors.torch import load_file

    weights = {}
    for file in Path(target_dir).glob("*.safetensors"):
        weights.update(load_file(str(file)))
    embed = weights["model.embed_tokens.weight"].float()
    tensors["specserve.embed_probe"] = embed[embed_probe_ids(vocab_size)].clone()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    draft_config = {**config, "num_hidden_layers": 1, "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(draft_config))
    meta = {"format": "specserve-draft", "version": 1, "method": "eagle", "aux_layers": aux,
            "target": str(target_dir), "draft_vocab_size": int(vocab or vocab_size)}  # fmt: skip
    (path / "draft.json").write_text(json.dumps(meta))
    return str(path)


def make_exact_eagle_draft(
    target_dir: str | Path, path: str | Path, noise: float = 0.0, served_as: str | None = None
) -> str:
    """An EAGLE draft that computes what its target computes, for a one-layer target with
    unit-RMS embeddings (make_tiny_model(num_hidden_layers=1, unit_rms_embeddings=True)):
    in_proj passes the normed embedding through (= the embedding) and ignores the hidden
    input, the decoder layer, final norm and head are the target's. Its drafts are the
    target's own tokens (every one accepted); ``noise`` (relative, on the layer's
    weights) makes it a close draft that is sometimes rejected. ``served_as``: the
    target as it will be served (its .gguf), whose embedding the draft is checked
    against at load."""
    import json

    from safetensors.torch import load_file, save_file

    from engine.spec_decode.trained_draft import embed_probe_ids

    config = json.loads((Path(target_dir) / "config.json").read_text())
    if config["num_hidden_layers"] != 1:
        raise ValueError("make_exact_eagle_draft needs a one-layer target")
    weights = {}
    for file in Path(target_dir).glob("*.safetensors"):
        weights.update(load_file(str(file)))
    hidden, vocab_size = config["hidden_size"], config["vocab_size"]
    gen = torch.Generator().manual_seed(7)
    tensors = {
        "eagle.fc.weight": torch.randn(hidden, hidden, generator=gen) * 0.1,
        "eagle.embed_norm.weight": torch.ones(hidden),
        "eagle.hidden_norm.weight": torch.ones(hidden),
        "eagle.in_proj.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1),
        "model.norm.weight": weights["model.norm.weight"],
    }
    for name, tensor in weights.items():
        if name.startswith("model.layers.0."):
            jitter = torch.randn(tensor.shape, generator=gen) * noise * tensor.std()
            tensors[name] = tensor + (jitter if "norm" not in name else 0)
    tensors["specserve.draft_vocab"] = torch.arange(vocab_size, dtype=torch.int64)
    probe_ids = embed_probe_ids(vocab_size)
    if served_as is None:
        probe = weights["model.embed_tokens.weight"].float()[probe_ids]
    else:
        from engine.loader import load_model

        served = load_model(str(served_as), dtype="float32", device="cpu")
        probe = served.model.embedding_rows(probe_ids).float()
    tensors["specserve.embed_probe"] = probe.clone()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    draft_config = {**config, "num_hidden_layers": 1, "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(draft_config))
    meta = {"format": "specserve-draft", "version": 1, "method": "eagle", "aux_layers": [0],
            "target": str(target_dir), "draft_vocab_size": vocab_size}  # fmt: skip
    (path / "draft.json").write_text(json.dumps(meta))
    return str(path)
