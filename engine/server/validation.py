"""Proto request -> engine arguments, validated at the edge.

Every check raises ``InvalidArgument`` whose message names the proto field and the
allowed range; nothing that fails here reaches the engine. SamplingParams keeps the
ranges it owns; we translate its field names into the proto's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from engine.io.sampling_params import (
    LOGIT_BIAS_LIMIT,
    MAX_LOGIT_BIAS_ENTRIES,
    SamplingParams,
    StructuredOutput,
)
from engine.rpc import generation_pb2 as pb
from engine.server.wire import num_prompt_ids

MAX_REQUEST_ID_LEN = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 64
MAX_CHAT_MESSAGES = 1024
PRIORITY_RANGE = (-1000, 1000)
# One token covers at most the tokenizer's longest vocabulary entry in characters
# (ModelInfo's max_token_chars, measured at startup), so text longer than max_model_len
# times that cannot fit the context window: it is refused before any tokenization.
# The floor keeps the bound loose for vocabularies of single characters (a normalizer
# may drop characters); the default serves when the tokenizer is unknown, and as the
# Tokenize RPC's bound (it may count text longer than the context).
MIN_CHARS_PER_TOKEN = 4
DEFAULT_CHARS_PER_TOKEN = 64
CHAT_ROLES = ("system", "user", "assistant", "tool")
_REQUEST_ID_RE = re.compile(r"[\x21-\x7e]+")

# SamplingParams field -> proto field path, for its ValueError messages.
_PARAM_PATHS = {
    "max_tokens": "sampling.max_tokens",
    "temperature": "sampling.temperature",
    "top_k": "sampling.top_k",
    "top_p": "sampling.top_p",
    "min_p": "sampling.min_p",
    "seed": "sampling.seed",
    "stop_token_ids": "sampling.stop_token_ids",
    "stop": "sampling.stop",
    "logprobs": "sampling.top_logprobs",
    "num_speculative_tokens": "speculation.num_speculative_tokens",
    "frequency_penalty": "sampling.frequency_penalty",
    "presence_penalty": "sampling.presence_penalty",
    "repetition_penalty": "sampling.repetition_penalty",
    "truncate_prompt_tokens": "sampling.truncate_prompt_tokens",
}


class InvalidArgument(ValueError):
    """A request field is out of range; the message names the field."""


@dataclass(slots=True)
class ModelLimits:
    """What validation needs to know about the loaded model."""

    vocab_size: int
    max_model_len: int
    max_token_chars: int = DEFAULT_CHARS_PER_TOKEN  # the longest token, in characters
    # The most drafts per step a request may ask for: the engine's
    # num_speculative_tokens, 0 when it does not speculate.
    max_spec_tokens: int = 0

    @classmethod
    def from_model_info(cls, info: dict[str, Any]) -> ModelLimits:
        return cls(
            vocab_size=int(info["vocab_size"]),
            max_model_len=int(info["max_model_len"]),
            max_spec_tokens=(
                0
                if info.get("speculative_method") in (None, "", "none")
                else int(info.get("num_speculative_tokens") or 0)
            ),
            max_token_chars=int(info.get("max_token_chars") or DEFAULT_CHARS_PER_TOKEN),
        )

    @property
    def chars_per_token(self) -> int:
        return max(self.max_token_chars, MIN_CHARS_PER_TOKEN)

    @property
    def max_prompt_chars(self) -> int:
        """More characters than this cannot encode to fewer than max_model_len tokens."""
        return self.max_model_len * self.chars_per_token

    @property
    def max_tokenize_chars(self) -> int:
        """Tokenize may count text longer than the context (to decide where to cut it);
        its bound only limits the work."""
        return self.max_model_len * max(self.chars_per_token, DEFAULT_CHARS_PER_TOKEN)


@dataclass(slots=True)
class EngineRequest:
    """Everything AsyncEngine.generate() takes, already validated."""

    request_id: str | None
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    params: SamplingParams
    priority: int


def to_engine_request(request: pb.GenerateRequest, limits: ModelLimits) -> EngineRequest:
    prompt, messages = _prompt(request, limits)
    priority = request.priority
    if not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        raise InvalidArgument(f"priority must be in [-1000, 1000], got {priority}")
    return EngineRequest(
        request_id=_request_id(request),
        prompt=prompt,
        messages=messages,
        params=to_sampling_params(request, limits),
        priority=priority,
    )


def to_sampling_params(request: pb.GenerateRequest, limits: ModelLimits) -> SamplingParams:
    s = request.sampling
    kwargs: dict[str, Any] = {}
    if s.HasField("max_tokens"):
        if not 1 <= s.max_tokens <= limits.max_model_len:
            raise InvalidArgument(
                f"sampling.max_tokens must be in [1, {limits.max_model_len}] "
                f"(max_model_len), got {s.max_tokens}"
            )
        kwargs["max_tokens"] = s.max_tokens
    if s.HasField("temperature"):
        if not math.isfinite(s.temperature):
            raise InvalidArgument(
                f"sampling.temperature must be a finite number >= 0, got {s.temperature}"
            )
        kwargs["temperature"] = s.temperature
    if s.HasField("top_k"):
        # top_k >= vocab_size keeps every token: the same as switching the filter off.
        kwargs["top_k"] = 0 if s.top_k >= limits.vocab_size else s.top_k
    for name in ("top_p", "min_p", "seed"):
        if s.HasField(name):
            kwargs[name] = getattr(s, name)
    if s.HasField("top_logprobs"):
        kwargs["logprobs"] = s.top_logprobs
    kwargs["stop"] = stop_strings("sampling.stop", s.stop)
    kwargs["stop_token_ids"] = _token_ids("sampling.stop_token_ids", s.stop_token_ids, limits)
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(
            f"sampling.stop_token_ids must have at most {MAX_STOP_TOKEN_IDS} ids, "
            f"got {len(s.stop_token_ids)}"
        )
    kwargs["ignore_eos"] = s.ignore_eos
    kwargs["num_speculative_tokens"] = _speculation(request, limits)
    kwargs.update(_logit_options(s, limits, kwargs.get("max_tokens", SamplingParams.max_tokens)))
    if s.HasField("structured_output"):
        kwargs["structured_output"] = structured_output(s.structured_output)
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise InvalidArgument(_proto_path_message(str(exc))) from None


def _logit_options(s: pb.SamplingOptions, limits: ModelLimits, max_tokens: int) -> dict:
    """Penalties, logit_bias, min_tokens, include_stop_str_in_output and
    truncate_prompt_tokens; SamplingParams checks the penalties' ranges."""
    if s.min_tokens > max_tokens:
        raise InvalidArgument(
            f"sampling.min_tokens must be in [0, {max_tokens}] (sampling.max_tokens), "
            f"got {s.min_tokens}"
        )
    kwargs: dict[str, Any] = {
        "frequency_penalty": s.frequency_penalty,
        "presence_penalty": s.presence_penalty,
        "min_tokens": s.min_tokens,
        "logit_bias": _logit_bias(s, limits),
        "include_stop_str_in_output": s.include_stop_str_in_output,
    }
    for name in ("repetition_penalty", "truncate_prompt_tokens"):
        if s.HasField(name):
            kwargs[name] = getattr(s, name)
    return kwargs


def _logit_bias(s: pb.SamplingOptions, limits: ModelLimits) -> dict[int, float]:
    if len(s.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidArgument(
            f"sampling.logit_bias must have at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
            f"got {len(s.logit_bias)}"
        )
    for token_id, value in s.logit_bias.items():
        if token_id >= limits.vocab_size:
            raise InvalidArgument(
                f"sampling.logit_bias keys must be token ids in [0, {limits.vocab_size - 1}] "
                f"(vocab_size - 1), got {token_id}"
            )
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:  # NaN fails too
            raise InvalidArgument(
                f"sampling.logit_bias[{token_id}] must be in [-100, 100], got {value}"
            )
    return dict(s.logit_bias)


def to_chat_messages(chat: pb.ChatMessages, field: str = "chat") -> list[dict[str, str]]:
    if not chat.messages:
        raise InvalidArgument(f"{field}.messages must have at least one message")
    if len(chat.messages) > MAX_CHAT_MESSAGES:
        raise InvalidArgument(
            f"{field}.messages must have at most {MAX_CHAT_MESSAGES} messages, "
            f"got {len(chat.messages)}"
        )
    for i, message in enumerate(chat.messages):
        if message.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"{field}.messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                f"got {message.role[:32]!r}"
            )
    return [{"role": m.role, "content": m.content} for m in chat.messages]


def _prompt(
    request: pb.GenerateRequest, limits: ModelLimits
) -> tuple[str | list[int] | None, list[dict[str, str]] | None]:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidArgument("prompt must be set: one of text, token_ids, chat")
    if kind == "text":
        if not request.text:
            raise InvalidArgument("text must be a non-empty string")
        check_text_length("text", len(request.text), limits)
        return request.text, None
    if kind == "token_ids":
        ids = request.token_ids.ids
        ids = _kept_prompt_ids(ids, num_prompt_ids(request, ids), request.sampling, limits)
        return _token_ids("token_ids.ids", ids, limits), None
    messages = to_chat_messages(request.chat)
    check_text_length("chat", sum(len(m["content"]) for m in messages), limits)
    return None, messages


def _kept_prompt_ids(ids: Any, num_ids: int, s: pb.SamplingOptions, limits: ModelLimits) -> Any:
    """The ids the engine keeps: 1 to max_model_len - 1 of them, counted after
    sampling.truncate_prompt_tokens. Truncation keeps the last n ids, so only those are
    read (and range-checked): per-id work on a 15M-id list held this event loop, health
    checks included, for over a second. ``num_ids`` counts the ids on the wire; ``ids``
    may hold only the last of them (wire.py)."""
    truncate = s.truncate_prompt_tokens if s.HasField("truncate_prompt_tokens") else 0
    num_kept = min(num_ids, truncate) if truncate >= 1 else num_ids
    if not 1 <= num_kept < limits.max_model_len:
        after = " after sampling.truncate_prompt_tokens" if num_kept < num_ids else ""
        raise InvalidArgument(
            f"token_ids.ids must have between 1 and {limits.max_model_len - 1} ids "
            f"(max_model_len - 1){after}, got {num_kept}"
        )
    return ids[-num_kept:] if num_kept < len(ids) else ids


def check_text_length(field: str, num_chars: int, limits: ModelLimits) -> None:
    max_chars = limits.max_prompt_chars
    if num_chars > max_chars:
        raise InvalidArgument(
            f"{field} must have at most {max_chars} characters (max_model_len "
            f"{limits.max_model_len} x {limits.chars_per_token}, the most characters one "
            f"token covers), got {num_chars}"
        )


def check_tokenize_length(field: str, num_chars: int, limits: ModelLimits) -> None:
    max_chars = limits.max_tokenize_chars
    if num_chars > max_chars:
        per_token = max_chars // limits.max_model_len
        raise InvalidArgument(
            f"{field} must have at most {max_chars} characters (max_model_len "
            f"{limits.max_model_len} x {per_token}), got {num_chars}"
        )


def _token_ids(field: str, ids: Any, limits: ModelLimits) -> list[int]:
    for token_id in ids:
        if token_id >= limits.vocab_size:
            raise InvalidArgument(
                f"{field} must be in [0, {limits.vocab_size - 1}] (vocab_size - 1), got {token_id}"
            )
    return list(ids)


def stop_strings(field: str, stop: Any) -> list[str]:
    """The stop strings of proto field ``field`` (both services share the limits)."""
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(
            f"{field} must have at most {MAX_STOP_STRINGS} strings, got {len(stop)}"
        )
    for text in stop:
        if not 1 <= len(text) <= MAX_STOP_STRING_LEN:
            raise InvalidArgument(
                f"{field} strings must have 1 to {MAX_STOP_STRING_LEN} characters, got {len(text)}"
            )
    return list(stop)


def _speculation(request: pb.GenerateRequest, limits: ModelLimits) -> int | None:
    if not request.HasField("speculation"):
        return None
    spec = request.speculation
    k = spec.num_speculative_tokens
    if spec.mode == pb.SpeculationOptions.MODE_FIXED:
        if not limits.max_spec_tokens:
            raise InvalidArgument(
                "speculation.mode MODE_FIXED needs speculative decoding; this server runs "
                "without it (speculative_method none)"
            )
        if not 1 <= k <= limits.max_spec_tokens:
            raise InvalidArgument(
                f"speculation.num_speculative_tokens must be in [1, {limits.max_spec_tokens}] "
                f"(the server's num_speculative_tokens) with MODE_FIXED, got {k}"
            )
        return k
    if spec.mode not in (pb.SpeculationOptions.MODE_UNSPECIFIED, pb.SpeculationOptions.MODE_OFF):
        raise InvalidArgument(
            "speculation.mode must be one of MODE_UNSPECIFIED, MODE_OFF, MODE_FIXED, "
            f"got {spec.mode}"
        )
    if k != 0:
        raise InvalidArgument(
            f"speculation.num_speculative_tokens must be 0 unless mode is MODE_FIXED, got {k}"
        )
    return 0 if spec.mode == pb.SpeculationOptions.MODE_OFF else None


def _request_id(request: pb.GenerateRequest) -> str | None:
    if not request.HasField("request_id"):
        return None
    request_id = request.request_id
    if len(request_id) > MAX_REQUEST_ID_LEN or not _REQUEST_ID_RE.fullmatch(request_id):
        raise InvalidArgument(
            f"request_id must be 1 to {MAX_REQUEST_ID_LEN} printable ASCII characters "
            "without spaces"
        )
    return request_id


def structured_output(message: pb.StructuredOutput) -> StructuredOutput:
    """The constraint a StructuredOutput message holds (its text members checked by
    StructuredOutput itself; compiling checks the rest, off this thread)."""
    kind = message.WhichOneof("constraint")
    if kind is None:
        raise InvalidArgument(
            "sampling.structured_output must set one of json_schema, regex, choice, grammar, "
            "json_object, structural_tag"
        )
    if kind == "json_object" and not message.json_object:
        raise InvalidArgument("sampling.structured_output.json_object must be true when set")
    value = list(message.choice.choices) if kind == "choice" else getattr(message, kind)
    try:
        return StructuredOutput(**{kind: value})
    except ValueError as exc:
        raise InvalidArgument(f"sampling.{exc}") from None


def _proto_path_message(message: str) -> str:
    for name, path in _PARAM_PATHS.items():
        if message.startswith(name + " "):
            return path + message[len(name) :]
    if message.startswith("structured_output"):
        return "sampling." + message
    return message
