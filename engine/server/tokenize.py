"""Prompt tokenization for the front end (Tokenize RPC, chat validation).

Mirrors what the engine does with a prompt, so Tokenize counts what Generate will use.
"""

from __future__ import annotations

from typing import Any

from engine.server.validation import InvalidArgument


def text_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text))


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The chat template applied with a generation prompt, as token ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument("chat: this model has no chat template; send text or token_ids")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja raises its own errors for messages a template refuses
        reason = " ".join(str(exc).split())[:200]
        raise InvalidArgument(
            f"chat: the model's chat template rejected the messages: {reason}"
        ) from None
    return list(tokenizer.encode(text, add_special_tokens=False))
