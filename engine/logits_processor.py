"""Penalties, logit bias and min_tokens: per-row adjustments of the raw logits, batched.

A row of logits samples one position, and its adjustments depend on the tokens before
that position. A request verifying drafts has rows for ``[last, d_1..d_k]``: row j
samples the token after ``d_j``, so it is adjusted as if ``d_1..d_j`` had already been
generated (counted by the penalties, and one more output token for min_tokens)::

    output so far | d_1 d_2 d_3
    row 0         |               <- counts of the output
    row 1         | d_1           <- + d_1
    row 2         | d_1 d_2       <- + d_1, d_2
    row 3         | d_1 d_2 d_3

So every row is adjusted exactly as plain decoding adjusts that position once the drafts
before it are accepted, which keeps verification lossless (and seeded coupling exact)
with these features. The order of operations is vLLM's: logit bias, the min_tokens mask,
the repetition penalty (prompt and output tokens), then frequency and presence
penalties (output tokens only). A row whose request does not use a feature is left
bit-for-bit alone by it, so a row's result never depends on its batch.

Nothing is built when no row uses any of it: the common batch pays one attribute check
per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, chain

import torch

from engine.sampling_params import SamplingParams
from scheduler.request import Request


@dataclass(slots=True)
class _Penalties:
    """Dense per-row state of the requests with penalties, [m, vocab_size] each."""

    counts: torch.Tensor  # float32: times each token was generated before the row
    seen: torch.Tensor | None  # bool: in the prompt or generated before the row
    frequency: torch.Tensor  # [m, 1]
    presence: torch.Tensor  # [m, 1]
    repetition: torch.Tensor | None  # [m, 1]; None when every row uses 1.0


@dataclass(slots=True)
class LogitsAdjustment:
    """The adjustments of one batch of logits rows; ``apply`` returns adjusted logits."""

    rows: torch.Tensor  # [m] int64: the logits rows of requests that use any feature
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row, token, value)
    masked: tuple[torch.Tensor, torch.Tensor] | None  # (row, token) held back by min_tokens
    penalties: _Penalties | None

    @classmethod
    def build(
        cls,
        requests: list[Request],  # one per request in the batch
        params: list[SamplingParams],
        drafts: list[list[int]],  # per request: the drafts before its rows
        num_rows: list[int],  # per request; its last row comes after all its drafts
        vocab_size: int,
        device: torch.device,
    ) -> LogitsAdjustment | None:
        """None when no request uses penalties, logit bias or min_tokens. Request i owns
        ``num_rows[i]`` consecutive rows; its row j is preceded by
        ``drafts[i][: len(drafts[i]) - num_rows[i] + 1 + j]``."""
        picked = [i for i, p in enumerate(params) if p.processes_logits]
        if not picked:
            return None
        starts = [0, *accumulate(num_rows)]
        spans = [_Span(requests[i], params[i], drafts[i], num_rows[i], starts[i]) for i in picked]
        row_ids = [span.start + j for span in spans for j in range(span.num_rows)]
        return cls(
            rows=torch.tensor(row_ids, dtype=torch.long, device=device),
            bias=_bias(spans, device),
            masked=_min_tokens_mask(spans, vocab_size, device),
            penalties=_penalties(spans, len(row_ids), vocab_size, device),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [n, vocab_size] float32 (left untouched: logprobs stay the raw
        model's). Returns a new [n, vocab_size] tensor with the rows adjusted."""
        sub = logits[self.rows]  # [m, vocab_size], a copy
        if self.bias is not None:
            row, token, value = self.bias
            sub.index_put_((row, token), value, accumulate=True)
        if self.masked is not None:
            sub[self.masked] = float("-inf")
        if self.penalties is not None:
            sub = _apply_penalties(sub, self.penalties)
        return logits.index_copy(0, self.rows, sub)


@dataclass(slots=True)
class _Span:
    """One request's rows: the first at ``start``, preceded by ``drafts[:first]``."""

    request: Request
    params: SamplingParams
    drafts: list[int]
    num_rows: int
    start: int  # its first row in the logits

    @property
    def first(self) -> int:
        """How many drafts come before the first row."""
        return len(self.drafts) - self.num_rows + 1

    def output_index(self, j: int) -> int:
        """The index among the request's output tokens of the token row j samples."""
        return self.request.num_output_tokens + self.first + j


def _bias(spans: list[_Span], device: torch.device):
    rows, tokens, values, local = [], [], [], 0
    for span in spans:
        bias = span.params.logit_bias
        for j in range(span.num_rows):
            rows += [local + j] * len(bias)
            tokens += bias.keys()
            values += bias.values()
        local += span.num_rows
    if not rows:
        return None
    return (
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(tokens, dtype=torch.long, device=device),
        torch.tensor(values, dtype=torch.float32, device=device),
    )


def _min_tokens_mask(spans: list[_Span], vocab_size: int, device: torch.device):
    """(row, token) of EOS and stop token ids in rows that sample an output token
    before ``min_tokens`` (the request's stop_token_ids already hold EOS unless
    ignore_eos)."""
    rows, tokens, local = [], [], 0
    for span in spans:
        stop_ids = [t for t in span.request.stop_token_ids if t < vocab_size]
        for j in range(span.num_rows):
            if span.output_index(j) < span.params.min_tokens:
                rows += [local + j] * len(stop_ids)
                tokens += stop_ids
        local += span.num_rows
    if not rows:
        return None
    return (
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(tokens, dtype=torch.long, device=device),
    )


def _penalties(
    spans: list[_Span], num_rows: int, vocab_size: int, device: torch.device
) -> _Penalties | None:
    if not any(span.params.has_penalties for span in spans):
        return None
    # Request k's output counts, then one copy per row plus the drafts before the row.
    outputs = [span.request.all_token_ids[span.request.num_prompt_tokens :] for span in spans]
    per_request = _scatter_counts(outputs, len(spans), vocab_size, device)
    row_owner = [k for k, span in enumerate(spans) for _ in range(span.num_rows)]
    counts = per_request[torch.tensor(row_owner, dtype=torch.long, device=device)]
    before = [span.drafts[: span.first + j] for span in spans for j in range(span.num_rows)]
    counts += _scatter_counts(before, num_rows, vocab_size, device)
    repetition = [span.params.repetition_penalty for span in spans]
    seen = None
    if any(r != 1.0 for r in repetition):
        prompts = [span.request.prompt_token_ids for span in spans]
        in_prompt = _scatter_counts(prompts, len(spans), vocab_size, device) > 0
        seen = in_prompt[torch.tensor(row_owner, dtype=torch.long, device=device)] | (counts > 0)

    def column(name: str) -> torch.Tensor:
        values = [getattr(span.params, name) for span in spans for _ in range(span.num_rows)]
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    return _Penalties(
        counts=counts,
        seen=seen,
        frequency=column("frequency_penalty"),
        presence=column("presence_penalty"),
        repetition=column("repetition_penalty") if seen is not None else None,
    )


def _scatter_counts(
    token_lists: list[list[int]], num_rows: int, vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[num_rows, vocab_size] float32: row r counts the tokens of token_lists[r]."""
    counts = torch.zeros((num_rows, vocab_size), dtype=torch.float32, device=device)
    lengths = [len(tokens) for tokens in token_lists]
    if not sum(lengths):
        return counts
    tokens = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    rows = torch.repeat_interleave(
        torch.arange(num_rows, device=device), torch.tensor(lengths, device=device)
    )
    flat = rows * vocab_size + tokens
    counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
    return counts


def _apply_penalties(logits: torch.Tensor, p: _Penalties) -> torch.Tensor:
    """logits: [m, vocab_size]. Neutral values (1.0, 0.0) leave a row exactly as it was:
    x / 1, x * 1 and x - 0 are exact."""
    if p.repetition is not None:
        scale = torch.where(p.seen, p.repetition, torch.ones_like(p.repetition))
        logits = torch.where(logits > 0, logits / scale, logits * scale)
    logits = logits - p.frequency * p.counts
    return logits - p.presence * (p.counts > 0).to(logits.dtype)
