"""Engine results -> vllm.grpc.engine messages (the shapes the gateway reads).

Streaming (the gateway's delta contract): one GenerateStreamChunk per output delta with
that delta's token ids and ``completion_tokens`` = their count (the gateway adds them
up), then a GenerateComplete for the choice carrying the finish reason, the stop that
matched, the cached prompt tokens and the speculation counts; as vLLM's servicer does,
its ``output_ids`` / ``completion_tokens`` repeat only the last delta. Not streaming:
one GenerateComplete per choice with every output id and the total count.
"""

from __future__ import annotations

import time
from typing import Any

from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from engine.io.outputs import RequestOutput, TokenLogprob

SERVER_TYPE = "vllm-grpc"  # what the gateway reads to pick its vLLM code paths


class ChoiceState:
    """What one choice (``index``) has produced so far."""

    __slots__ = ("index", "token_ids", "logprobs", "last")

    def __init__(self, index: int) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.last: RequestOutput | None = None

    def add(self, output: RequestOutput) -> None:
        self.token_ids += output.token_ids
        if output.logprobs:
            self.logprobs += output.logprobs
        self.last = output


def chunk(output: RequestOutput, index: int, num_logprobs: int | None) -> vpb.GenerateResponse:
    """One streamed delta of choice ``index``."""
    message = vpb.GenerateStreamChunk(
        token_ids=output.token_ids,
        prompt_tokens=_num_prompt_tokens(output),
        completion_tokens=len(output.token_ids),
        cached_tokens=output.metrics.num_cached_prompt_tokens,
        index=index,
    )
    if num_logprobs is not None and output.logprobs:
        message.output_logprobs.CopyFrom(_logprobs(output.logprobs, num_logprobs))
    return vpb.GenerateResponse(chunk=message)


def complete(
    choice: ChoiceState,
    num_logprobs: int | None,
    eos_token_ids: frozenset[int],
    stream: bool,
) -> vpb.GenerateResponse:
    """The end of one choice (its last output finished): in a stream its last delta
    only, else everything."""
    last = choice.last  # the finished output
    token_ids = last.token_ids if stream else choice.token_ids
    logprobs = (last.logprobs or []) if stream else choice.logprobs
    m = last.metrics
    message = vpb.GenerateComplete(
        output_ids=token_ids,
        finish_reason=last.finish_reason or "stop",
        prompt_tokens=_num_prompt_tokens(last),
        completion_tokens=len(token_ids),
        cached_tokens=m.num_cached_prompt_tokens,
        index=choice.index,
        spec_accepted_tokens=m.num_accepted_tokens,
        spec_draft_tokens=m.num_draft_tokens,
    )
    if num_logprobs is not None and logprobs:
        message.output_logprobs.CopyFrom(_logprobs(logprobs, num_logprobs))
    _matched_stop(message, last, eos_token_ids)
    return vpb.GenerateResponse(complete=message)


def aborted(index: int) -> vpb.GenerateResponse:
    """The end of choice ``index`` aborted before its prompt was encoded: no tokens, and
    no prompt tokens counted (none reached the engine)."""
    return vpb.GenerateResponse(complete=vpb.GenerateComplete(finish_reason="abort", index=index))


def model_info(info: dict[str, Any]) -> vpb.GetModelInfoResponse:
    max_model_len = int(info.get("max_model_len") or 0)
    response = vpb.GetModelInfoResponse(
        model_path=str(info.get("model_dir") or info.get("model") or ""),
        is_generation=True,
        max_context_length=max_model_len,
        vocab_size=int(info.get("vocab_size") or 0),
        supports_vision=False,
        served_model_name=str(info.get("model") or ""),
        tokenizer_path=str(info.get("tokenizer_dir") or ""),
        model_type=str(info.get("model_type") or ""),
        architectures=[str(a) for a in info.get("architectures") or ()],
        eos_token_ids=[int(t) for t in info.get("eos_token_ids") or ()],
        max_req_input_len=max(0, max_model_len - 1),
    )
    for field in ("pad_token_id", "bos_token_id"):
        if info.get(field) is not None:
            setattr(response, field, int(info[field]))
    return response


def server_info(
    info: dict[str, Any], num_in_flight: int, start_time: float, last_receive_time: float
) -> vpb.GetServerInfoResponse:
    dtype = str(info.get("dtype") or "")
    kv_dtype = str(info.get("kv_cache_dtype") or dtype)
    return vpb.GetServerInfoResponse(
        active_requests=num_in_flight,
        is_paused=False,
        last_receive_timestamp=last_receive_time,
        uptime_seconds=time.time() - start_time,
        server_type=SERVER_TYPE,
        data_parallel_size=1,
        # vLLM's names: "auto" is the model's dtype (--kv-cache-dtype as given)
        kv_cache_dtype="auto" if kv_dtype == dtype else kv_dtype,
        block_size=int(info.get("block_size") or 0),
        model_dtype=f"torch.{dtype}" if dtype else "",
        max_num_seqs=int(info.get("max_num_seqs") or 0),
    )


def _num_prompt_tokens(output: RequestOutput) -> int:
    return output.metrics.num_prompt_tokens or len(output.prompt_token_ids)


def _matched_stop(
    message: vpb.GenerateComplete, output: RequestOutput, eos_token_ids: frozenset[int]
) -> None:
    reason = output.stop_reason
    if isinstance(reason, str):
        message.matched_stop_str = reason
    # As vLLM reports it: a stop token the request named; EOS is no "matched stop".
    elif isinstance(reason, int) and reason not in eos_token_ids:
        message.matched_token_id = reason


def _logprobs(logprobs: list[TokenLogprob], num_top: int) -> vpb.OutputLogProbs:
    message = vpb.OutputLogProbs()
    for lp in logprobs:
        message.token_logprobs.append(lp.logprob)
        message.token_ids.append(lp.token_id)
        if num_top:
            top = lp.top[:num_top]
            message.top_logprobs.append(
                vpb.TopLogProbs(values=[p for _, p in top], token_ids=[t for t, _ in top])
            )
    return message
