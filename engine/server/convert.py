"""Engine results -> proto messages. Proto types stop here and in the servicer."""

from __future__ import annotations

from typing import Any

from engine.io.outputs import RequestOutput, TokenLogprob
from engine.observability.stats import EngineStats, PoolStats
from engine.rpc import generation_pb2 as pb

FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


def to_response(output: RequestOutput, num_completion_tokens: int) -> pb.GenerateResponse:
    """One streamed delta; usage and finish reason only on the last one."""
    # The caller's id, echoed; request_id is the engine's internal key.
    response = pb.GenerateResponse(
        request_id=output.label, text=output.text, token_ids=output.token_ids
    )
    if output.logprobs:
        response.logprobs.extend(_logprobs(output.logprobs))
    if output.finished:
        _finish(response, output, num_completion_tokens)
    return response


def to_complete_response(
    request_id: str, outputs: list[RequestOutput]
) -> pb.GenerateCompleteResponse:
    """Concatenate a request's deltas into one reply."""
    response = pb.GenerateCompleteResponse(request_id=request_id)
    texts: list[str] = []
    for output in outputs:
        texts.append(output.text)
        response.token_ids.extend(output.token_ids)
        if output.logprobs:
            response.logprobs.extend(_logprobs(output.logprobs))
    response.text = "".join(texts)
    if outputs:
        _finish(response, outputs[-1], len(response.token_ids))
    return response


def to_model_info(info: dict[str, Any]) -> pb.ModelInfo:
    return pb.ModelInfo(
        model=str(info.get("model") or ""),
        draft_model=str(info.get("draft_model") or ""),
        speculative_method=str(info.get("speculative_method") or ""),
        num_speculative_tokens=int(info.get("num_speculative_tokens") or 0),
        block_size=int(info.get("block_size") or 0),
        max_model_len=int(info.get("max_model_len") or 0),
        vocab_size=int(info.get("vocab_size") or 0),
        max_num_seqs=int(info.get("max_num_seqs") or 0),
        max_waiting_requests=int(info.get("max_waiting_requests") or 0),
        num_kv_blocks=int(info.get("num_kv_blocks") or 0),
        eos_token_ids=[int(t) for t in info.get("eos_token_ids") or ()],
        device=str(info.get("device") or ""),
        dtype=str(info.get("dtype") or ""),
        attn_backend=str(info.get("attn_backend") or ""),
        quantization=str(info.get("quantization") or ""),
        kv_cache_dtype=str(info.get("kv_cache_dtype") or ""),
    )


def to_server_stats(stats: EngineStats | None, num_in_flight: int) -> pb.ServerStats:
    response = pb.ServerStats(num_in_flight=num_in_flight)
    if stats is None:  # no engine step yet
        return response
    response.num_running = stats.num_running
    response.num_waiting = stats.num_waiting
    response.num_steps = stats.num_steps
    response.target_pool.CopyFrom(_pool(stats.target_pool))
    if stats.draft_pool is not None:
        response.draft_pool.CopyFrom(_pool(stats.draft_pool))
    return response


def _finish(
    response: pb.GenerateResponse | pb.GenerateCompleteResponse,
    output: RequestOutput,
    num_completion_tokens: int,
) -> None:
    response.finish_reason = FINISH_REASONS.get(output.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
    if isinstance(output.stop_reason, str):
        response.stop_string = output.stop_reason
    elif isinstance(output.stop_reason, int):
        response.stop_token_id = output.stop_reason
    if output.finish_detail:
        response.finish_detail = output.finish_detail
    m = output.metrics
    response.usage.CopyFrom(
        pb.Usage(
            prompt_tokens=m.num_prompt_tokens or len(output.prompt_token_ids),
            completion_tokens=num_completion_tokens,
            cached_prompt_tokens=m.num_cached_prompt_tokens,
            draft_tokens=m.num_draft_tokens,
            accepted_draft_tokens=m.num_accepted_tokens,
            time_to_first_token_s=m.time_to_first_token or 0.0,
        )
    )


def _logprobs(logprobs: list[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top],
        )
        for lp in logprobs
    ]


def _pool(pool: PoolStats) -> pb.KvPoolStats:
    return pb.KvPoolStats(
        num_blocks_in_use=pool.num_blocks_in_use,
        num_free_blocks=pool.num_free_blocks,
        num_blocks=pool.num_blocks,
    )
