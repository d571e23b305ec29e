"""Architecture description of a Llama-family checkpoint, parsed from a HF config.json."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelArchConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None or a dict with "rope_type" in ("linear", "llama3") and that type's parameters.
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    architectures: tuple[str, ...]
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    # Mistral-style sliding-window attention. We attend to the full context, which is
    # exact only up to this many tokens, so the context window is capped there.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a positive multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even number, got {self.head_dim}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in _SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; "
                f"supported: {', '.join(_SUPPORTED_ROPE_TYPES)}"
            )

    @property
    def eos_token_ids(self) -> set[int]:
        if self.eos_token_id is None:
            return set()
        if isinstance(self.eos_token_id, int):
            return {self.eos_token_id}
        return set(self.eos_token_id)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | Any) -> ModelArchConfig:
        """Build from a config.json dict or a transformers ``PretrainedConfig``."""
        cfg = dict(config) if isinstance(config, Mapping) else config.to_dict()
        num_heads = cfg["num_attention_heads"]
        rope_theta, rope_scaling = _parse_rope(cfg)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(cfg),
            architectures=architectures_of(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            sliding_window=_sliding_window(cfg),
        )


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    # Qwen2 configs carry a window but switch it off with use_sliding_window=false.
    if not window or (cfg.get("model_type") == "qwen2" and not cfg.get("use_sliding_window")):
        return None
    return int(window)


# model_type -> architecture; GGUF files name these the same in general.architecture.
_MODEL_TYPE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def architectures_of(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """The config's ``architectures``, else the one its ``model_type`` implies."""
    if cfg.get("architectures"):
        return tuple(cfg["architectures"])
    # Some converted configs carry only model_type.
    fallback = _MODEL_TYPE_ARCHITECTURES.get(cfg.get("model_type", ""))
    return (fallback,) if fallback else ()


def _attention_bias(cfg: dict[str, Any]) -> bool:
    # Qwen2 always has q/k/v biases but its config has no attention_bias field.
    if cfg.get("model_type") == "qwen2" or "Qwen2ForCausalLM" in (cfg.get("architectures") or ()):
        return True
    return bool(cfg.get("attention_bias", False))


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from transformers 5 ``rope_parameters`` or the older fields."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:
        params = params["full_attention"]
    if isinstance(params, Mapping):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling
