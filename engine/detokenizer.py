"""Incremental detokenization with stop strings.

Text is decoded over a sliding window of token ids (a few tokens of context before
the new ones, so tokenizers that drop a leading space when decoding a token alone
still get it right). A delta that ends in U+FFFD is an incomplete multi-byte
character and is held back until the next token completes it. Text that could be the
start of a stop string is held back until it is resolved either way.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self._max_stop_len = max((len(s) for s in stop), default=0)
        self._pending = ""  # decoded but held back (partial stop string)
        self.text = ""  # everything emitted so far

    def push(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Add new tokens. Returns (text to emit now, the stop string hit or None).
        After a stop string is hit the request is over; the emitted text excludes it."""
        self._ids.extend(token_ids)
        decode = self._tokenizer.decode
        prefix = decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True
        )
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return "", None
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._apply_stop(delta)

    def flush(self) -> str:
        """Release held-back text when the request ends for another reason."""
        out, self._pending = self._pending, ""
        self.text += out
        return out

    def _apply_stop(self, delta: str) -> tuple[str, str | None]:
        if not self._stop:
            self.text += delta
            return delta, None
        buf = self._pending + delta
        hit, hit_at = None, len(buf)
        for stop in self._stop:
            at = buf.find(stop)
            if at != -1 and at < hit_at:
                hit, hit_at = stop, at
        if hit is not None:
            out, self._pending = buf[:hit_at], ""
            self.text += out
            return out, hit
        keep = self._held_back_len(buf)
        out, self._pending = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self.text += out
        return out, None

    def _held_back_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        for size in range(min(len(buf), self._max_stop_len - 1), 0, -1):
            tail = buf[-size:]
            if any(stop.startswith(tail) for stop in self._stop):
                return size
        return 0
