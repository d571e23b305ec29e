"""Text and chat prompts -> token ids, off the event loop and off the engine thread.

A 500k-character prompt takes about 0.3 s to encode. Done on the engine thread it
stalls every running stream; done on the event loop it stalls health checks and every
RPC. HF fast tokenizers release the GIL while the Rust encoder runs (measured: a 1 ms
sleeper thread saw gaps of at most 10-15 ms while another thread encoded 520k
characters, against 250 ms through the raw ``tokenizers`` call that keeps the GIL), so a
worker thread is enough to keep both responsive.

Two single-thread lanes: prompts up to ``LARGE_PROMPT_CHARS`` and larger ones. A flood
of huge prompts then queues behind itself, never in front of a short prompt, and never
takes more than one core. Each lane owns its tokenizer copy: a Rust tokenizer must not
be used by two threads at once.

Measured end to end (SmolLM2, a server on 2 cores, 20 simultaneous 522k-character
prompts): health answered within 50 ms (was 0.81 s); another stream's longest
inter-token gap was 0.10 s against a 0.06 s baseline with ``--num-threads 1`` (was
7.2 s). With torch's threads on every core the long lane runs at the lowest CPU
priority (``_lower_priority``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.errors import EngineShutdownError

# Encoding this many characters takes about 40 ms; it is about the most an 8k context
# holds (8 characters per token). Longer prompts go to the low-priority lane: mostly
# ones that are refused as too long, from a prefix, after waiting for idle CPU.
LARGE_PROMPT_CHARS = 65536


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token covers: the longest vocabulary entry
    (byte-level entries spell one character per byte, so they never undercount)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


# A text longer than this many characters per allowed token is first encoded in part:
# when that prefix alone has the margin more tokens than allowed, the whole text has
# too many (cutting a text changes its tokens only next to the cut), and the rest is
# never encoded. A 522k-character prompt for an 8k context costs a tenth of its encoding.
_PREFIX_CHARS_PER_TOKEN = 8
_PREFIX_MARGIN_TOKENS = 64


def encode_text(tokenizer: Any, text: str, max_tokens: int | None = None) -> list[int]:
    return _encode(tokenizer, text, True, max_tokens, "the prompt")


def encode_chat(
    tokenizer: Any, messages: list[dict[str, str]], max_tokens: int | None = None
) -> list[int]:
    """The chat template applied with a generation prompt, as token ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat: this model has no chat template; send a text or token-id prompt")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja raises its own errors for messages a template refuses
        reason = " ".join(str(exc).split())[:200]
        message = f"chat: the model's chat template rejected the messages: {reason}"
        raise ValueError(message) from None
    return _encode(tokenizer, text, False, max_tokens, "chat: the templated prompt")


def _encode(
    tokenizer: Any, text: str, special: bool, max_tokens: int | None, what: str
) -> list[int]:
    """``text`` as token ids; ValueError when it has more than ``max_tokens``."""
    if max_tokens is not None:
        cut = (max_tokens + _PREFIX_MARGIN_TOKENS) * _PREFIX_CHARS_PER_TOKEN
        if len(text) > cut:
            cut = text.rfind(" ", 0, cut) + 1 or cut  # where tokenizers split anyway
            num_tokens = len(tokenizer.encode(text[:cut], add_special_tokens=special))
            if num_tokens >= max_tokens + _PREFIX_MARGIN_TOKENS:
                raise _too_long(what, f"more than {num_tokens}", max_tokens)
    ids = list(tokenizer.encode(text, add_special_tokens=special))
    if max_tokens is not None and len(ids) > max_tokens:
        raise _too_long(what, str(len(ids)), max_tokens)
    return ids


def _too_long(what: str, num_tokens: str, max_tokens: int) -> ValueError:
    return ValueError(
        f"{what} has {num_tokens} tokens; the context window allows at most {max_tokens} "
        f"prompt tokens (max_model_len {max_tokens + 1})"
    )


def _lower_priority() -> None:
    """Run this worker thread at the lowest CPU priority (Linux nice values are per
    thread). torch's parallel regions wait for their slowest thread, so a long encoding
    that takes a core from one of them stalls every stream; at nice 19 it mostly gets
    what torch leaves idle. Measured (SmolLM2, 2 cores, torch on both, 20 simultaneous
    522k-character prompts while a stream runs, 6 runs each): the stream's longest gap
    went from 2.9-5.1x its baseline to 1.0-1.7x (median 1.03x), health answered within
    46 ms; the flood itself took 36-42 s to encode instead of 5.5 s."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class PromptEncoder:
    """Encodes prompts on two worker threads (short and long prompts)."""

    def __init__(self, tokenizer: Any) -> None:
        self.max_token_chars = longest_token_chars(tokenizer)
        self._closed = False
        # The long lane runs at the lowest priority: running streams come first.
        self._lanes = [
            (
                ThreadPoolExecutor(1, f"tokenize-{name}", initializer=initializer),
                copy.deepcopy(tokenizer),
            )
            for name, initializer in (("short", None), ("long", _lower_priority))
        ]

    async def encode(
        self,
        prompt: str | None,
        messages: list[dict[str, str]] | None = None,
        max_tokens: int | None = None,
    ) -> list[int]:
        """``messages`` through the chat template, else ``prompt``; ValueError for a
        template that refuses the messages (the message names the field) and for a
        prompt of more than ``max_tokens`` tokens (a long one is refused from a
        prefix, without encoding the rest)."""
        if messages is not None:
            num_chars = sum(len(m.get("content") or "") for m in messages)
            encode, prompt_or_messages = encode_chat, messages
        else:
            num_chars = len(prompt or "")
            encode, prompt_or_messages = encode_text, prompt or ""
        pool, tokenizer = self._lanes[num_chars > LARGE_PROMPT_CHARS]
        loop = asyncio.get_running_loop()
        try:
            future = loop.run_in_executor(
                pool, self._run, encode, tokenizer, prompt_or_messages, max_tokens
            )
        except RuntimeError:  # the pool is shut down
            raise EngineShutdownError("engine is shutting down") from None
        return await future

    def shutdown(self) -> None:
        """Queued prompts end with EngineShutdownError instead of being encoded."""
        self._closed = True
        for pool, _ in self._lanes:
            pool.shutdown(wait=False)

    def _run(self, encode, tokenizer: Any, prompt: Any, max_tokens: int | None) -> list[int]:
        if self._closed:
            raise EngineShutdownError("engine is shutting down")
        return encode(tokenizer, prompt, max_tokens)
