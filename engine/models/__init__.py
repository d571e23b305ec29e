"""Model implementations written for the paged KV cache."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM
from engine.models.registry import SUPPORTED_ARCHITECTURES, get_model_class

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaForCausalLM", "get_model_class"]
