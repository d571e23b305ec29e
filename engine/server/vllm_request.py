"""vllm.grpc.engine GenerateRequest -> engine arguments, validated at the edge.

Every refusal is an ``InvalidArgument`` naming the proto field (``sampling_params.top_p``,
``tokenized.input_ids``, ...) and what is allowed. What this server does not do is
refused by name, never ignored: prompt logprobs, multimodal input, KV transfer, and
data-parallel ranks other than 0. Every member of the ``constraint`` oneof (what the
gateway makes of ``response_format``, ``tool_choice`` and its regex / choice extensions)
becomes the request's StructuredOutput.

Proto conventions (the gateway's, from vLLM): ``temperature`` unset is 1.0; ``top_p`` 0
and ``repetition_penalty`` 0 mean unset (1.0); ``n`` 0 is 1; ``max_tokens`` unset is
the rest of the context; ``truncate_prompt_tokens`` -1 is the whole context; ``seed`` is
an int32 whose negative values stand for their unsigned bit pattern. The gateway
detokenizes, so ``skip_special_tokens`` and ``spaces_between_special_tokens`` change
nothing here (stop strings are matched on text decoded without special tokens).

Choice i of an ``n > 1`` request with a seed runs with ``seed + i * 2**32``: every
choice differs, choice 0 is the same request with ``n = 1``, and no choice's seed is
another request's plain seed (those are below 2**32).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from engine.io.sampling_params import SamplingParams, StructuredOutput
from engine.server.validation import (
    MAX_REQUEST_ID_LEN,
    MAX_STOP_TOKEN_IDS,
    InvalidArgument,
    ModelLimits,
    check_text_length,
    check_tokenize_length,
    stop_strings,
)
from engine.server.wire import num_prompt_ids

# The most samples one request may ask for (each is a request of its own to the engine).
MAX_CHOICES = 64
MAX_LOGPROBS = 20
CHOICE_SEED_STRIDE = 2**32
_REQUEST_ID_RE = re.compile(r"[\x21-\x7e]+")
P = "sampling_params."
# What SamplingParams takes today; the logit-processing fields are refused by name
# wherever this engine does not have them yet.
_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


@dataclass(slots=True)
class VllmRequest:
    """A validated Generate request, before its prompt is encoded."""

    label: str | None
    prompt_ids: list[int] | None  # tokenized input
    text: str | None  # text input, encoded by the engine's encoder
    stream: bool
    num_choices: int
    logprobs: int | None
    # SamplingParams keywords shared by every choice; max_tokens and seed are per choice.
    kwargs: dict[str, Any]
    max_tokens: int | None
    seed: int | None
    truncate_prompt_tokens: int | None

    def prompt(self, prompt_ids: list[int], limits: ModelLimits) -> list[int]:
        """The prompt as the engine will see it: truncated, checked against the context."""
        if self.truncate_prompt_tokens is not None:
            prompt_ids = prompt_ids[-self.truncate_prompt_tokens :]
        if len(prompt_ids) >= limits.max_model_len:
            field = "tokenized.input_ids" if self.prompt_ids is not None else "text"
            raise InvalidArgument(
                f"{field} has {len(prompt_ids)} tokens; the context window allows at most "
                f"{limits.max_model_len - 1} (max_model_len {limits.max_model_len} - 1)"
            )
        return prompt_ids

    def sampling_params(self, num_prompt_tokens: int, limits: ModelLimits) -> list[SamplingParams]:
        """One SamplingParams per choice."""
        max_tokens = self.max_tokens or limits.max_model_len - num_prompt_tokens
        params = []
        for index in range(self.num_choices):
            seed = None if self.seed is None else self.seed + index * CHOICE_SEED_STRIDE
            try:
                params.append(SamplingParams(**self.kwargs, max_tokens=max_tokens, seed=seed))
            except ValueError as exc:
                raise InvalidArgument(_proto_path(str(exc))) from None
        return params


def to_vllm_request(
    request: vpb.GenerateRequest, limits: ModelLimits, max_choices: int
) -> VllmRequest:
    _refuse_unsupported(request)
    s = request.sampling_params
    prompt_ids, text = _input(request, limits)
    kwargs = _sampling_kwargs(s, limits)
    return VllmRequest(
        label=_label(request.request_id),
        prompt_ids=prompt_ids,
        text=text,
        stream=request.stream,
        num_choices=_num_choices(s, max_choices),
        logprobs=kwargs.get("logprobs"),
        kwargs=kwargs,
        max_tokens=_max_tokens(s, limits),
        seed=(s.seed & 0xFFFFFFFF) if s.HasField("seed") else None,
        truncate_prompt_tokens=kwargs.get("truncate_prompt_tokens"),
    )


def _label(request_id: str) -> str | None:
    """The caller's id (a label: several requests may share it); None when empty."""
    if not request_id:
        return None
    if len(request_id) > MAX_REQUEST_ID_LEN or not _REQUEST_ID_RE.fullmatch(request_id):
        raise InvalidArgument(
            f"request_id must be 1 to {MAX_REQUEST_ID_LEN} printable ASCII characters "
            "without spaces"
        )
    return request_id


def _refuse_unsupported(request: vpb.GenerateRequest) -> None:
    s = request.sampling_params
    if s.HasField("prompt_logprobs"):
        raise InvalidArgument(f"{P}prompt_logprobs is not supported by this server")
    if request.HasField("mm_inputs") or request.extra_mm_inputs:
        field = "mm_inputs" if request.HasField("mm_inputs") else "extra_mm_inputs"
        raise InvalidArgument(f"{field}: multimodal input is not supported (text models only)")
    if request.HasField("media_refs"):
        raise InvalidArgument("media_refs: multimodal input is not supported (text models only)")
    for field in ("kv_transfer_params", "kv_transfer_params_json"):
        if request.HasField(field):
            raise InvalidArgument(
                f"{field}: KV transfer (prefill/decode disaggregation) is not supported"
            )
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise InvalidArgument(
            "data_parallel_rank must be 0 or unset (this server has one rank), "
            f"got {request.data_parallel_rank}"
        )


def _input(
    request: vpb.GenerateRequest, limits: ModelLimits
) -> tuple[list[int] | None, str | None]:
    kind = request.WhichOneof("input")
    truncating = request.sampling_params.HasField("truncate_prompt_tokens")
    if kind == "tokenized":
        ids = _kept_input_ids(request, limits)
        _check_token_ids("tokenized.input_ids", ids, limits)
        return ids, None
    if kind == "text":
        if not request.text:
            raise InvalidArgument("text must be a non-empty string")
        # Truncation keeps the last tokens of a text that may be longer than the context.
        check = check_tokenize_length if truncating else check_text_length
        check("text", len(request.text), limits)
        return None, request.text
    raise InvalidArgument("input must be set: one of tokenized, text")


def _kept_input_ids(request: vpb.GenerateRequest, limits: ModelLimits) -> list[int]:
    """The ids the engine keeps: the last truncate_prompt_tokens of them, fewer than
    max_model_len. Only those are read (and range-checked): per-id work on a 15M-id
    list held this event loop, health checks included, for over a second. A large
    request may arrive with only the last of its ids decoded (wire.py)."""
    ids = request.tokenized.input_ids
    num_ids = num_prompt_ids(request, ids)
    if not num_ids:
        raise InvalidArgument("tokenized.input_ids must have at least one id")
    truncate = _truncate_prompt_tokens(request.sampling_params, limits)
    num_kept = num_ids if truncate is None else min(num_ids, truncate)
    if num_kept >= limits.max_model_len:
        after = f" after {P}truncate_prompt_tokens" if num_kept < num_ids else ""
        raise InvalidArgument(
            f"tokenized.input_ids must have at most {limits.max_model_len - 1} ids "
            f"(max_model_len - 1){after}, got {num_kept}"
        )
    return ids[-num_kept:]


def _sampling_kwargs(s: vpb.SamplingParams, limits: ModelLimits) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "temperature": _temperature(s),
        "top_p": s.top_p if s.top_p != 0.0 else 1.0,
        # top_k >= vocab_size keeps every token: the same as switching the filter off.
        "top_k": 0 if s.top_k >= limits.vocab_size else s.top_k,
        "min_p": s.min_p,
        "stop": stop_strings(f"{P}stop", s.stop),
        "stop_token_ids": _stop_token_ids(s, limits),
        "ignore_eos": s.ignore_eos,
    }
    if s.HasField("logprobs"):
        if not 0 <= s.logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(
                f"{P}logprobs must be in [0, {MAX_LOGPROBS}] (-1, every token, is not "
                f"supported), got {s.logprobs}"
            )
        kwargs["logprobs"] = s.logprobs
    kwargs.update(_logit_processing(s, limits))
    constraint = _constraint(s)
    if constraint is not None:
        kwargs["structured_output"] = constraint
    return kwargs


def _constraint(s: vpb.SamplingParams) -> StructuredOutput | None:
    """The constraint oneof as a StructuredOutput (json_object's text is vLLM's flag:
    any JSON object; compiling checks the rest, off the event loop)."""
    kind = s.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_object":
        value: Any = True
    elif kind == "choice":
        value = list(s.choice.choices)
    else:
        value = getattr(s, kind)
    try:
        return StructuredOutput(**{kind: value})
    except ValueError as exc:
        raise InvalidArgument(P + str(exc).removeprefix("structured_output.")) from None


def _logit_processing(s: vpb.SamplingParams, limits: ModelLimits) -> dict[str, Any]:
    """The penalty / bias / min_tokens / stop-string / truncation fields: passed on where
    the engine has them, refused by name where it does not and the request sets them."""
    wanted: dict[str, tuple[Any, bool]] = {  # name -> (value, set to something non-default)
        "frequency_penalty": (s.frequency_penalty, s.frequency_penalty != 0.0),
        "presence_penalty": (s.presence_penalty, s.presence_penalty != 0.0),
        "repetition_penalty": (
            s.repetition_penalty or 1.0,
            s.repetition_penalty not in (0.0, 1.0),
        ),
        "min_tokens": (s.min_tokens, s.min_tokens != 0),
        "logit_bias": (_logit_bias(s, limits), bool(s.logit_bias)),
        "include_stop_str_in_output": (
            s.include_stop_str_in_output,
            s.include_stop_str_in_output,
        ),
        "truncate_prompt_tokens": (
            _truncate_prompt_tokens(s, limits),
            s.HasField("truncate_prompt_tokens"),
        ),
    }
    kwargs = {}
    for name, (value, is_set) in wanted.items():
        if name in _ENGINE_FIELDS:
            kwargs[name] = value
        elif is_set:
            raise InvalidArgument(f"{P}{name} is not supported by this server yet")
    return kwargs


def _temperature(s: vpb.SamplingParams) -> float:
    if not s.HasField("temperature"):
        return 1.0
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise InvalidArgument(f"{P}temperature must be a finite number >= 0, got {s.temperature}")
    return s.temperature


def _max_tokens(s: vpb.SamplingParams, limits: ModelLimits) -> int | None:
    if not s.HasField("max_tokens"):
        return None
    if not 1 <= s.max_tokens <= limits.max_model_len:
        raise InvalidArgument(
            f"{P}max_tokens must be in [1, {limits.max_model_len}] (max_model_len), "
            f"got {s.max_tokens}"
        )
    return s.max_tokens


def _num_choices(s: vpb.SamplingParams, max_choices: int) -> int:
    n = s.n or 1
    if n > max_choices:
        raise InvalidArgument(
            f"{P}n must be in [1, {max_choices}] (each sample is a request of its own), got {n}"
        )
    return n


def _truncate_prompt_tokens(s: vpb.SamplingParams, limits: ModelLimits) -> int | None:
    if not s.HasField("truncate_prompt_tokens"):
        return None
    value = s.truncate_prompt_tokens
    if value == -1:
        return limits.max_model_len - 1
    if value < 1:
        raise InvalidArgument(
            f"{P}truncate_prompt_tokens must be -1 (the whole context) or >= 1, got {value}"
        )
    return value


def _logit_bias(s: vpb.SamplingParams, limits: ModelLimits) -> dict[int, float]:
    for token_id in s.logit_bias:
        if not 0 <= token_id < limits.vocab_size:
            raise InvalidArgument(
                f"{P}logit_bias token ids must be in [0, {limits.vocab_size - 1}] "
                f"(vocab_size - 1), got {token_id}"
            )
    return dict(s.logit_bias)


def _stop_token_ids(s: vpb.SamplingParams, limits: ModelLimits) -> list[int]:
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(
            f"{P}stop_token_ids must have at most {MAX_STOP_TOKEN_IDS} ids, "
            f"got {len(s.stop_token_ids)}"
        )
    _check_token_ids(f"{P}stop_token_ids", s.stop_token_ids, limits)
    return list(s.stop_token_ids)


def _check_token_ids(field: str, ids: Any, limits: ModelLimits) -> None:
    for token_id in ids:
        if token_id >= limits.vocab_size:
            raise InvalidArgument(
                f"{field} must be in [0, {limits.vocab_size - 1}] (vocab_size - 1), got {token_id}"
            )


def _proto_path(message: str) -> str:
    """SamplingParams names its own fields; the caller sent the proto's."""
    names = sorted(_ENGINE_FIELDS, key=len, reverse=True)
    for name in names:
        if message.startswith((name + " ", name + "[")):
            return P + message
    return message
