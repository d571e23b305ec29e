"""Incremental detokenization with stop strings.

Text is decoded over a sliding window of token ids (a few tokens of context before
the new ones, so tokenizers that drop a leading space when decoding a token alone
still get it right). A delta that ends in U+FFFD is an incomplete multi-byte
character and is held back until the next token completes it. Text that could be the
start of a stop string is held back until it is resolved either way (unless the stop
string stays in the output: then everything emitted is a prefix of the final text).

A stop string counts only when it ends in text pushed with ``check_stop`` (the engine
turns it on once ``min_tokens`` tokens are out, for the tokens after them), so an
occurrence that ended earlier never stops the request later.
"""

from __future__ import annotations

from functools import partial

_CONTEXT_TOKENS = 6


def fast_decode(tokenizer):
    """``ids -> tokenizer.decode(ids, skip_special_tokens=True)``: a fast (Rust)
    tokenizer's own ``decode`` where transformers' wrapper adds nothing to it (no
    clean-up of spaces, neither method overridden), else the wrapper. Two decodes a
    token and request: the wrapper's Python took 7 of the 9.5 us each (hot; more with
    the caches cold after a decode step's weights)."""
    wrapped = partial(tokenizer.decode, skip_special_tokens=True)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers: its wrapper
        return wrapped
    cls = type(tokenizer)
    if (
        backend is None
        or getattr(tokenizer, "clean_up_tokenization_spaces", True)
        or getattr(cls, "decode", None) is not PreTrainedTokenizerBase.decode
        or getattr(cls, "_decode", None) is not TokenizersBackend._decode
    ):
        return wrapped
    return partial(backend.decode, skip_special_tokens=True)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop: bool = False,
    ) -> None:
        self._decode = fast_decode(tokenizer)
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self._include_stop = include_stop
        self._max_stop_len = max((len(s) for s in stop), default=0)
        self._pending = ""  # decoded but held back (partial stop string)
        self.text = ""  # everything emitted so far

    def push(self, token_ids: list[int], check_stop: bool = True) -> tuple[str, str | None]:
        """Add new tokens. Returns (text to emit now, the stop string hit or None).
        After a stop string is hit the request is over; the emitted text excludes it
        (includes it, with ``include_stop``)."""
        self._ids.extend(token_ids)
        decode = self._decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset])
        full = decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return "", None
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if not self._stop:
            return self._emit(delta), None
        if self._include_stop:
            return self._apply_stop_included(delta, check_stop)
        return self._apply_stop(delta, check_stop)

    def flush(self) -> str:
        """Release held-back text when the request ends for another reason."""
        out, self._pending = self._pending, ""
        return self._emit(out)

    def _emit(self, out: str) -> str:
        self.text += out
        return out

    def _apply_stop(self, delta: str, check_stop: bool) -> tuple[str, str | None]:
        buf = self._pending + delta
        if check_stop:
            hit, at = self._find_stop(buf, len(self._pending))
            if hit is not None:
                self._pending = ""
                return self._emit(buf[:at]), hit
        keep = self._held_back_len(buf)
        out, self._pending = buf[: len(buf) - keep], buf[len(buf) - keep :]
        return self._emit(out), None

    def _apply_stop_included(self, delta: str, check_stop: bool) -> tuple[str, str | None]:
        if check_stop:
            # The stop string may start in text already emitted.
            tail = self.text[max(0, len(self.text) - self._max_stop_len + 1) :]
            hit, at = self._find_stop(tail + delta, len(tail))
            if hit is not None:
                return self._emit(delta[: at + len(hit) - len(tail)]), hit
        return self._emit(delta), None

    def _find_stop(self, buf: str, num_old: int) -> tuple[str | None, int]:
        """The stop string that starts first among those ending after ``buf[:num_old]``
        (text searched before), and where it starts."""
        hit, hit_at = None, len(buf)
        for stop in self._stop:
            at = buf.find(stop, max(0, num_old - len(stop) + 1))
            if at != -1 and at < hit_at:
                hit, hit_at = stop, at
        return hit, hit_at

    def _held_back_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        for size in range(min(len(buf), self._max_stop_len - 1), 0, -1):
            tail = buf[-size:]
            if any(stop.startswith(tail) for stop in self._stop):
                return size
        return 0
