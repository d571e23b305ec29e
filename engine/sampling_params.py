"""Per-request sampling parameters, validated where they are built."""

from __future__ import annotations

from dataclasses import dataclass, field

_MAX_SEED = 2**63 - 1
# The most draft tokens per step anything may ask for (an engine's
# num_speculative_tokens); a request may ask for at most its engine's value.
MAX_NUM_SPECULATIVE_TOKENS = 16


@dataclass
class SamplingParams:
    """How one request is decoded.

    ``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` and ``min_p == 0``
    switch those filters off. ``num_speculative_tokens`` overrides the engine's
    speculation length for this request (``0`` turns speculation off for it).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        check_int("max_tokens", self.max_tokens, 1, None)
        _check_float("temperature", self.temperature, 0.0, None, "[0, inf)")
        check_int("top_k", self.top_k, 0, None)
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_float("min_p", self.min_p, 0.0, 1.0, "[0, 1]")
        if self.seed is not None:
            check_int("seed", self.seed, 0, _MAX_SEED)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        for token_id in self.stop_token_ids:
            check_int("stop_token_ids", token_id, 0, None)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, 20)
        if self.num_speculative_tokens is not None:
            check_int(
                "num_speculative_tokens", self.num_speculative_tokens, 0, MAX_NUM_SPECULATIVE_TOKENS
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def check_int(name: str, value: object, lo: int, hi: int | None) -> None:
    """ValueError naming the field and its allowed range unless value is an int in it."""
    allowed = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be {allowed}, got {value}")


def _check_float(name: str, value: object, lo: float, hi: float | None, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number in {allowed}, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be in {allowed}, got {value}")
