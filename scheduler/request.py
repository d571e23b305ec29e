"""A request as the scheduler sees it: token ids, counters and status. No tensors."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from scheduler.spec_length import AcceptanceHistory


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One generation request.

    Token layout (``num_computed_tokens`` counts tokens whose KV is cached)::

        all_token_ids:  | prompt ............ | outputs ....... |
                        0                  num_prompt      num_tokens
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    # Generation stops at any of these (EOS included unless ignore_eos).
    stop_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower runs first; ties by arrival (FCFS)
    arrival_time: float = field(default_factory=time.monotonic)
    # Per-request speculation cap (None: the engine's; 0: never speculate).
    max_spec_tokens: int | None = None
    # Opaque to the scheduler; the engine keeps its sampling params here.
    sampling_params: Any = None

    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    # Speculation bookkeeping: acceptance history for adaptive k.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    spec_history: AcceptanceHistory = field(default_factory=AcceptanceHistory)
    # One history per proposer when the engine combines several (hybrid speculation).
    spec_histories: dict[str, AcceptanceHistory] = field(default_factory=dict)
    # Tokens the request's output constraint allows one by one from here, set by the
    # engine before each schedule: they get lookahead slots, speculation on or off, and
    # verification keeps them all (not counted as drafts).
    num_forced_tokens: int = 0
    # Lookahead slots past k for a constrained request's speculating steps: room for the
    # tokens its constraint forces right after the drafts (verified in the same pass).
    forced_tail_slots: int = 0
    first_scheduled_time: float | None = None
    # Whose cache of recent answers a proposer may use for this request (the caller's
    # API key id; None: callers without one).
    cache_scope: str | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    def history_for(self, source: str | None) -> AcceptanceHistory:
        if source is None:
            return self.spec_history
        return self.spec_histories.setdefault(source, AcceptanceHistory())

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.arrival_time)

    def append_output_tokens(self, token_ids: list[int]) -> list[int]:
        """Append sampled tokens, stopping inside the run at a stop token or the length
        limit. Returns the tokens actually kept; sets finish_reason when it stops."""
        kept: list[int] = []
        for token_id in token_ids:
            self.all_token_ids.append(token_id)
            kept.append(token_id)
            if token_id in self.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", token_id
                break
            if self.num_output_tokens >= self.max_tokens:
                self.finish_reason = "length"
                break
        return kept
