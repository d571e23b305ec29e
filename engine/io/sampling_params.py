"""Per-request sampling parameters, validated where they are built."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_MAX_SEED = 2**63 - 1
# The most draft tokens per step anything may ask for (an engine's
# num_speculative_tokens); a request may ask for at most its engine's value.
MAX_NUM_SPECULATIVE_TOKENS = 16
# logit_bias: at most this many entries, each value in [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT]
# (OpenAI's limits).
MAX_LOGIT_BIAS_ENTRIES = 1024
LOGIT_BIAS_LIMIT = 100.0


# Structured output: the most text a constraint may hold, and the most choices.
MAX_CONSTRAINT_CHARS = 64 * 1024
MAX_CHOICES = 256
CONSTRAINT_KINDS = ("json_schema", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output text: exactly one of the fields.

    ``json_schema``: a JSON Schema (JSON text, or a dict); ``regex``: the whole output
    matches it; ``choice``: the output is one of these strings; ``grammar``: a Lark
    grammar (llguidance's dialect) or a GBNF one (llama.cpp's, recognised by ``::=``)
    whose ``start`` (Lark) or ``root`` (GBNF) rule the output matches;
    ``json_object``: any JSON object; ``structural_tag``: vLLM's structural tag (JSON
    text: ``structures`` of ``begin`` / ``schema`` / ``end`` and their ``triggers``),
    free text with schema-constrained tool calls inside.
    """

    json_schema: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json_schema, dict):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_output must set exactly one of {', '.join(CONSTRAINT_KINDS)}, "
                f"got {', '.join(given) or 'none'}"
            )
        for kind in ("json_schema", "regex", "grammar", "structural_tag"):
            _check_constraint_text(f"structured_output.{kind}", getattr(self, kind))
        if self.json_schema is not None or self.structural_tag is not None:
            kind = "json_schema" if self.json_schema is not None else "structural_tag"
            try:
                parsed = json.loads(getattr(self, kind))
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_output.{kind} is not JSON: {exc}") from None
            if not isinstance(parsed, dict):
                raise ValueError(f"structured_output.{kind} must be a JSON object")
        if self.choice is not None:
            if not 1 <= len(self.choice) <= MAX_CHOICES:
                raise ValueError(
                    f"structured_output.choice must hold 1 to {MAX_CHOICES} strings, "
                    f"got {len(self.choice)}"
                )
            for c in self.choice:
                if not isinstance(c, str) or not c:
                    raise ValueError("structured_output.choice must hold non-empty strings")
            _check_constraint_text("structured_output.choice", "".join(self.choice))
        if not isinstance(self.json_object, bool):
            raise ValueError(
                f"structured_output.json_object must be true or false, got {self.json_object!r}"
            )

    @property
    def kind(self) -> str:
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False))


def _check_constraint_text(name: str, text: object) -> None:
    if text is None:
        return
    if not isinstance(text, str) or not text:
        raise ValueError(f"{name} must be a non-empty string")
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ValueError(
            f"{name} must be at most {MAX_CONSTRAINT_CHARS} characters, got {len(text)}"
        )


@dataclass
class SamplingParams:
    """How one request is decoded.

    ``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` and ``min_p == 0``
    switch those filters off. ``num_speculative_tokens`` overrides the engine's
    speculation length for this request (``0`` turns speculation off for it).

    Logit processing, in this order, on the raw logits before temperature and the
    filters (greedy is the argmax of the result): ``logit_bias`` (token id -> value) is
    added; the first ``min_tokens`` output tokens cannot be EOS (unless ``ignore_eos``)
    or ``stop_token_ids`` (masked), nor complete a stop string (not checked); a token
    seen in the prompt or the output has a positive logit divided by
    ``repetition_penalty`` and a negative one multiplied; a token generated ``c`` times
    loses ``frequency_penalty * c + presence_penalty * (c > 0)``. Reported logprobs stay
    the raw model's. ``truncate_prompt_tokens`` keeps only the last n prompt tokens.
    ``structured_output`` (a ``StructuredOutput``, or a dict of its fields) then masks
    every token the constraint does not allow at that point, after those adjustments
    and before temperature and the filters: the output follows the model's distribution
    renormalized over what the constraint allows.
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
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_output, dict):
            self.structured_output = StructuredOutput(**self.structured_output)
        if self.structured_output is not None and not isinstance(
            self.structured_output, StructuredOutput
        ):
            raise ValueError(
                "structured_output must be a StructuredOutput or a dict of its fields, "
                f"got {type(self.structured_output).__name__}"
            )
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
        self._check_logit_processing()

    def _check_logit_processing(self) -> None:
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "[-2, 2]")
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0, "[-2, 2]")
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 2.0, "(0, 2]")
        if self.repetition_penalty == 0.0:
            raise ValueError("repetition_penalty must be in (0, 2], got 0.0")
        check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        self.logit_bias = _checked_logit_bias(self.logit_bias)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(
                "include_stop_str_in_output must be true or false, "
                f"got {self.include_stop_str_in_output!r}"
            )
        if self.truncate_prompt_tokens is not None:
            check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, None)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def processes_logits(self) -> bool:
        """Whether any penalty, bias or min_tokens changes this request's logits."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0


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


def _checked_logit_bias(bias: object) -> dict[int, float]:
    """A copy of ``bias`` with float values; ValueError naming the field otherwise. Token
    ids are checked against the vocabulary when the request reaches an engine."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a mapping of token id to number, got {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(
            f"logit_bias must have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}"
        )
    limit = LOGIT_BIAS_LIMIT
    checked: dict[int, float] = {}
    for token_id, value in bias.items():
        check_int("logit_bias token id", token_id, 0, None)
        _check_float(f"logit_bias[{token_id}]", value, -limit, limit, "[-100, 100]")
        checked[token_id] = float(value)
    return checked
