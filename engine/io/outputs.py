"""What the engine hands back to callers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # The most likely tokens at this position as (token_id, logprob), best first.
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    """A request's output.

    From ``LLMEngine.step()`` and ``AsyncEngine.generate()`` it is a *delta*: the
    tokens and text produced since the previous output of that request. From
    ``LLM.generate()`` it is the whole completion.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    metrics: RequestMetrics
    # The stop string or stop token id that ended the request, if any.
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    # finish_reason "error" where the caller's input is not at fault (the model's
    # logits were not finite): why, on the last output only. None for a constraint's
    # failure, which is the caller's (finish_detail says why).
    error: str | None = None
    # The id the caller gave the request, a label for logs and replies; several requests
    # may share one. ``request_id`` is the engine's own key, unique among its requests.
    # None: the same as request_id.
    client_request_id: str | None = None
    # Why the output may not satisfy the request's structured_output constraint (it
    # ended at max_tokens first, or at a dead end), on the last output only.
    finish_detail: str | None = None

    @property
    def label(self) -> str:
        """The caller's id for the request: what logs and replies show."""
        return self.request_id if self.client_request_id is None else self.client_request_id
