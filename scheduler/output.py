"""The one dataclass that crosses from the scheduler to the model runner, and back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    The runner feeds ``all_token_ids[num_computed_tokens : num_computed_tokens + n]``
    (n = ``num_scheduled_tokens`` minus the drafts) followed by the drafts, at positions
    ``num_computed_tokens ...``. When the request catches up (``needs_sample``) it
    samples one token from the last position, or verifies the drafts.
    """

    request_id: str
    num_computed_tokens: int  # before this step
    num_scheduled_tokens: int  # tokens fed this step, drafts included
    block_ids: list[int]  # the whole block table
    needs_sample: bool
    num_spec_tokens: int  # lookahead slots granted; the proposer fills up to this many
    spec_token_ids: list[int] = field(default_factory=list)
    # A token tree's parent of each draft (-1: the last verified token), topological;
    # None: the drafts are a chain. Each node takes one lookahead slot; verification
    # keeps one path (num_accepted of them), moved into place before the update.
    spec_parents: list[int] | None = None
    # Which of the request's acceptance histories chose k (None: its only one).
    spec_source: str | None = None
    # One more verified token's cost in plain decode steps of this batch (proposing and
    # verifying it): what a tree proposer prices its nodes against.
    spec_token_cost: float = 0.0
    # Lookahead slots granted past num_spec_tokens (a constrained request's forced tail),
    # and how many of spec_token_ids, at the end, are such forced tokens (not drafts).
    num_tail_slots: int = 0
    num_forced_tail: int = 0

    @property
    def num_proposed(self) -> int:
        """The drafts a proposer made (what acceptance statistics count)."""
        return len(self.spec_token_ids) - self.num_forced_tail


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class ModelRunnerOutput:
    """Per scheduled request that sampled: the tokens to append (accepted drafts
    followed by one recovered or bonus token) and how many drafts were accepted."""

    sampled_token_ids: dict[str, list[int]]
    num_accepted: dict[str, int] = field(default_factory=dict)
    # Optional per-token logprobs, opaque to the scheduler.
    logprobs: dict[str, list] = field(default_factory=dict)
    # Per request that verified a token tree: the accepted nodes (indices into its
    # drafts), root's child first; their KV moves into place (opaque to the scheduler).
    accepted_nodes: dict[str, list[int]] = field(default_factory=dict)
