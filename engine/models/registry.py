"""Which model class serves which HF ``architectures`` entry."""

from __future__ import annotations

from torch import nn

from engine.models.llama import LlamaForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}

SUPPORTED_ARCHITECTURES = tuple(_MODELS)


def get_model_class(architectures: list[str] | tuple[str, ...]) -> type[nn.Module]:
    """The class for the first supported entry; ValueError naming them otherwise."""
    for arch in architectures:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(
        f"unsupported model architecture {', '.join(architectures) or '(none given)'}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
