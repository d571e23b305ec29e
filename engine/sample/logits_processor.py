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

A token tree's row is adjusted under its node's path instead (the tokens from the root
down to it; engine/spec_decode/paths.py). So every row is adjusted exactly as plain
decoding adjusts that position once the drafts before it are accepted, which keeps
verification lossless (and seeded coupling exact) with these features. The order of
operations is vLLM's: logit bias, the min_tokens mask, the repetition penalty (prompt
and output tokens), then frequency and presence penalties (output tokens only). A logit
no feature of its row touches is left bit-for-bit alone, so a row's result never
depends on its batch.

Everything is sparse: each feature is a list of flat indices ``row * vocab_size +
token`` into the logits (the tokens a row has seen, counted on the host, spread over
the request's rows on the device), so the work grows with the tokens a request has
seen, not with the vocabulary, and no dense [rows, vocab_size] count is ever built.
Nothing is built when no row uses any of it: the common batch pays one attribute check
per request.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import accumulate

import torch

from engine.io.sampling_params import SamplingParams
from engine.spec_decode.paths import row_prefixes
from scheduler.request import Request


@dataclass(slots=True)
class LogitsAdjustment:
    """The adjustments of one batch of logits rows; ``apply`` returns adjusted logits.
    Every index is a flat ``row * vocab_size + token``, unique within its field."""

    bias: tuple[torch.Tensor, torch.Tensor] | None  # (index [b], value [b])
    masked: torch.Tensor | None  # index [c]: EOS / stop token ids before min_tokens
    seen: tuple[torch.Tensor, torch.Tensor] | None  # (index [s], repetition penalty [s])
    # (index [g], times generated [g], frequency penalty [g], presence penalty [g])
    generated: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None

    @classmethod
    def build(
        cls,
        requests: list[Request],  # one per request in the batch
        params: list[SamplingParams],
        drafts: list[list[int]],  # per request: the drafts before its rows
        num_rows: list[int],  # per request; its last row comes after all its drafts
        vocab_size: int,
        device: torch.device,
        parents: list[list[int] | None] | None = None,  # per request: a tree's, or None
    ) -> LogitsAdjustment | None:
        """None when no request uses penalties, logit bias or min_tokens. Request i owns
        ``num_rows[i]`` consecutive rows; its row j is preceded by
        ``drafts[i][: len(drafts[i]) - num_rows[i] + 1 + j]``, or for a token tree
        (``parents[i]`` set, one row per node after the root's) by the path of node
        ``j - 1``."""
        picked = [i for i, p in enumerate(params) if p.processes_logits]
        if not picked:
            return None
        starts = [0, *accumulate(num_rows)]
        spans = []
        for i in picked:
            tree = parents[i] if parents is not None else None
            if tree is not None:
                prefixes = row_prefixes(drafts[i], tree)
            else:
                first = len(drafts[i]) - num_rows[i] + 1
                prefixes = [drafts[i][: first + j] for j in range(num_rows[i])]
            spans.append(_Span(requests[i], params[i], prefixes, starts[i], vocab_size, device))
        return cls(
            bias=_bias(spans),
            masked=_min_tokens_mask(spans),
            seen=_seen(spans),
            generated=_generated(spans),
        )

    @torch.inference_mode()  # the runner's logits are inference tensors
    def apply(self, logits: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """logits: [n, vocab_size] float32. Returns them adjusted: a new tensor (the
        raw logits stay for logprobs), or ``in_place`` the same one when contiguous."""
        out = logits if in_place and logits.is_contiguous() else logits.contiguous().clone()
        flat = out.view(-1)
        if self.bias is not None:
            index, value = self.bias
            flat[index] += value
        if self.masked is not None:
            flat[self.masked] = float("-inf")
        if self.seen is not None:
            index, repetition = self.seen
            x = flat[index]
            flat[index] = torch.where(x > 0, x / repetition, x * repetition)
        if self.generated is not None:
            index, count, frequency, presence = self.generated
            flat[index] = flat[index] - frequency * count - presence
        return out


@dataclass(slots=True)
class _Span:
    """One request's rows from ``start`` on: row j is preceded by ``prefixes[j]`` (the
    drafts before the position it samples)."""

    request: Request
    params: SamplingParams
    prefixes: list[list[int]]
    start: int  # its first row in the logits
    vocab_size: int
    device: torch.device

    @property
    def num_rows(self) -> int:
        return len(self.prefixes)

    def output_index(self, j: int) -> int:
        """The index among the request's output tokens of the token row j samples."""
        return self.request.num_output_tokens + len(self.prefixes[j])

    def in_every_row(self, token_ids: list[int]) -> torch.Tensor:
        """Flat indices of ``token_ids`` in each of the span's rows, row after row."""
        tokens = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        rows = torch.arange(self.start, self.start + self.num_rows, device=self.device)
        return (rows.unsqueeze(1) * self.vocab_size + tokens.unsqueeze(0)).flatten()

    def seen(self) -> torch.Tensor:
        """Flat indices of the tokens in the prompt or generated before each row."""
        request = self.request
        base = set(request.all_token_ids)  # prompt and output
        index = [self.in_every_row(list(base))]
        extra = [
            (self.start + j) * self.vocab_size + token
            for j, prefix in enumerate(self.prefixes)
            for token in set(prefix) - base
        ]
        return torch.cat([*index, _index(extra, self.device)])

    def generated(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat indices of the tokens generated before each row, and how many times:
        the output's counts in every row, plus row j's preceding drafts."""
        request = self.request
        base = Counter(request.all_token_ids[request.num_prompt_tokens :])
        tokens = list(base)
        position = {token: i for i, token in enumerate(tokens)}
        index = self.in_every_row(tokens)  # [num_rows * len(tokens)]
        count = torch.tensor(list(base.values()), dtype=torch.float32).repeat(self.num_rows)
        more_at, more, extra_index, extra_count = [], [], [], []
        for j, prefix in enumerate(self.prefixes):
            for token, num in Counter(prefix).items():
                if token in position:  # generated before too: one count for both
                    more_at.append(j * len(tokens) + position[token])
                    more.append(num)
                else:
                    extra_index.append((self.start + j) * self.vocab_size + token)
                    extra_count.append(num)
        count.index_add_(0, _index(more_at, "cpu"), torch.tensor(more, dtype=torch.float32))
        count = torch.cat([count, torch.tensor(extra_count, dtype=torch.float32)])
        return torch.cat([index, _index(extra_index, self.device)]), count.to(self.device)

    def full(self, like: torch.Tensor, value: float) -> torch.Tensor:
        return torch.full(like.shape, value, dtype=torch.float32, device=self.device)


def _index(values: list[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _bias(spans: list[_Span]):
    biased = [span for span in spans if span.params.logit_bias]
    if not biased:
        return None
    index = torch.cat([span.in_every_row(list(span.params.logit_bias)) for span in biased])
    values = [list(span.params.logit_bias.values()) * span.num_rows for span in biased]
    flat = [v for row in values for v in row]
    return index, torch.tensor(flat, dtype=torch.float32, device=index.device)


def _min_tokens_mask(spans: list[_Span]) -> torch.Tensor | None:
    """EOS and stop token ids in rows that sample one of the first ``min_tokens``
    output tokens (the request's stop_token_ids hold EOS unless ignore_eos)."""
    index = []
    for span in spans:
        vocab_size = span.vocab_size
        stop_ids = [t for t in span.request.stop_token_ids if t < vocab_size]
        for j in range(span.num_rows):
            if span.output_index(j) < span.params.min_tokens:
                index += [(span.start + j) * vocab_size + t for t in stop_ids]
    return _index(index, spans[0].device) if index else None


def _seen(spans: list[_Span]):
    """Repetition penalty: every token in the prompt or generated before the row."""
    chosen = [span for span in spans if span.params.repetition_penalty != 1.0]
    if not chosen:
        return None
    index = [span.seen() for span in chosen]
    values = [span.full(i, span.params.repetition_penalty) for span, i in zip(chosen, index)]
    return torch.cat(index), torch.cat(values)


def _generated(spans: list[_Span]):
    """Frequency and presence penalties: each token generated before the row, counted."""
    chosen = [s for s in spans if s.params.frequency_penalty or s.params.presence_penalty]
    if not chosen:
        return None
    index, count, frequency, presence = [], [], [], []
    for span in chosen:
        i, c = span.generated()
        index.append(i)
        count.append(c)
        frequency.append(span.full(i, span.params.frequency_penalty))
        presence.append(span.full(i, span.params.presence_penalty))
    return torch.cat(index), torch.cat(count), torch.cat(frequency), torch.cat(presence)
