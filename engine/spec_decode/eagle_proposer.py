"""EAGLE proposer: a one-layer draft over the target's own hidden states
(engine/spec_decode/eagle.py has the contract), with its own paged KV cache.

Per request, with M verified tokens and the target having computed positions < M - 1::

    features:  f_j = fc(g_j) for the positions the target computed, kept from each
               target forward until the draft has read them
    draft KV:  [0, n), every position fed with the target's features
    burst:     step 1 feeds positions n .. M-1 (h = f_{n-1} .. f_{M-2}) and samples d_1
               from the last one; step s feeds d_{s-1} at position M+s-2 with h = the
               draft's own output at the position before

After verification the draft KV keeps [0, M) (what step 1 fed) and rolls the drafted
positions back, accepted or not: their hidden input was the draft's own, and the next
burst feeds the accepted tokens again with the target's features. Features the draft
lacks (a prefix the target had cached and the draft had not) read as zeros: the drafts
get worse, verification keeps the output exact either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention.metadata import set_attention_metadata
from engine.config import EngineConfig
from engine.core.model_runner import SeqInput
from engine.spec_decode.draft_model import DraftModelProposer, _num_params
from engine.spec_decode.eagle import EagleDraftForCausalLM
from scheduler.step_cost import DraftCostMeter

# Features kept for a request the draft has not caught up on (one that does not
# speculate: fixed k = 0, or a batch above --speculative-disable-batch-size); older
# ones are dropped and read as zeros if it speculates later.
MAX_PENDING_FEATURES = 4096


@dataclass(slots=True, eq=False)
class _EagleRequest:
    """Satisfies block_manager.CacheRequest; shares the target's verified token list."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    fed: list[int] = field(default_factory=list)  # fed this burst, from fed_start
    fed_start: int = 0
    num_catchup: int = 0  # of ``fed``: verified tokens with the target's features

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass(slots=True, eq=False)
class _Features:
    """f_j of one request for positions start .. end - 1, kept as the chunks the target's
    forwards made (a step appends its rows without copying the ones before: a request
    that does not speculate for a while gathers them for as long) and joined when read.

    Invariant: no chunk is a view into a storage more than twice its size (``_own``), so
    the memory held is proportional to the rows kept: a row sliced from a step's whole
    feature tensor would keep every other request's rows of that step alive."""

    start: int
    chunks: list[torch.Tensor]  # [num, H] each
    end: int

    def __post_init__(self) -> None:
        self.chunks = [_own(chunk) for chunk in self.chunks]

    @property
    def rows(self) -> torch.Tensor:  # [end - start, H]
        if len(self.chunks) > 1:
            self.chunks = [torch.cat(self.chunks)]
        return self.chunks[0]

    def append(self, rows: torch.Tensor) -> None:
        self.chunks.append(_own(rows))
        self.end += len(rows)


def _own(rows: torch.Tensor) -> torch.Tensor:
    """``rows``, copied when they are a view into a storage over twice their size (a
    step's few rows, or a short slice of a long prefill's); a big share of the storage
    is kept as it is, uncopied."""
    num_bytes = rows.nelement() * rows.element_size()
    return rows.clone() if rows.untyped_storage().nbytes() > 2 * num_bytes else rows


class EagleProposer(DraftModelProposer):
    def __init__(self, config: EngineConfig, draft_loaded, target_loaded, num_blocks: int) -> None:
        if not isinstance(draft_loaded.model, EagleDraftForCausalLM):
            raise ValueError(f"{draft_loaded.name} is not an EAGLE draft (made by "
                             "`specserve train-draft --method eagle`)")  # fmt: skip
        super().__init__(config, draft_loaded, target_loaded, num_blocks)
        self._features: dict[str, _Features] = {}
        self._out: torch.Tensor | None = None  # the draft's outputs o in a burst's last step
        self.model: EagleDraftForCausalLM = draft_loaded.model
        self.hidden_size = draft_loaded.arch.hidden_size
        # The target keeps the residual stream entering these layers after each forward.
        self.target_model = target_loaded.model.model
        self.target_model.capture_layers = tuple(self.model.aux_layers)
        # A draft step is one decoder layer, in_proj and the reduced head (fc is paid
        # once per target token, in on_target_forward).
        streamed = _num_params(draft_loaded) - self.model.fc_params
        self.draft_cost = streamed / _num_params(target_loaded) + 0.02
        self.cost_meter = DraftCostMeter(self.draft_cost)

    def _draft_request(self, request) -> _EagleRequest:
        ereq = self._requests.get(request.request_id)
        if ereq is None:
            ereq = _EagleRequest(request.request_id, request.all_token_ids)
            self._requests[request.request_id] = ereq
        return ereq

    # ---- features from the target's forward ------------------------------------------
    def on_target_forward(self, items, seqs: list[SeqInput]) -> None:
        """Keep f for every position the target just computed (``items`` are the
        scheduled requests, ``seqs`` their inputs in the same order)."""
        captured = self.target_model.captured
        self.target_model.captured = None
        if captured is None:
            return
        fused = self.model.fuse(captured.to(self.model.dtype))
        row = 0
        for item, seq in zip(items, seqs):
            n = len(seq.token_ids)
            self._append_features(item.request_id, seq.start_pos, fused[row : row + n])
            row += n

    def _append_features(self, request_id: str, start: int, rows: torch.Tensor) -> None:
        old = self._features.get(request_id)
        if old is None or not old.start <= start <= old.end:
            self._features[request_id] = _Features(start, [rows], start + len(rows))
        elif start == old.end:  # the next positions: the usual step
            old.append(rows)
        else:
            # positions from ``start`` on were drafts the target rejected (or are
            # computed again): the new rows replace them
            kept = old.rows[: start - old.start]
            self._features[request_id] = _Features(old.start, [kept, rows], start + len(rows))
        feats = self._features[request_id]
        if feats.end - feats.start > MAX_PENDING_FEATURES + 256:  # cut now and then, not each step
            drop = feats.end - feats.start - MAX_PENDING_FEATURES
            self._features[request_id] = _Features(
                feats.start + drop, [feats.rows[drop:]], feats.end
            )

    def on_accepted_nodes(self, request_id: str, base: int, nodes: list[int]) -> None:
        """A token tree's accepted path: the target computed node ``nodes[k]``'s
        features in the row of position ``base + nodes[k]`` (its slot); they belong to
        position ``base + k``, where its KV moves (sources never lie below their
        destinations, so moving in order reads nothing already overwritten)."""
        feats = self._features.get(request_id)
        if feats is None:
            return
        rows = feats.rows
        with torch.inference_mode():  # the rows may be inference tensors
            for k, node in enumerate(nodes):
                dst, src = base + k - feats.start, base + node - feats.start
                if node != k and dst >= 0 and src < len(rows):
                    rows[dst] = rows[src]

    def _trim_features(self, ereq: _EagleRequest, valid_end: int) -> None:
        """Keep the features of positions [draft KV length - 1, valid_end)."""
        feats = self._features.get(ereq.request_id)
        if feats is None:
            return
        lo = max(ereq.num_computed_tokens - 1 - feats.start, 0)
        hi = max(valid_end - feats.start, lo)
        kept = feats.rows[lo:hi]
        if len(kept):
            start = feats.start + lo
            self._features[ereq.request_id] = _Features(start, [kept], start + len(kept))
        else:
            del self._features[ereq.request_id]

    def _hidden_for(self, ereq: _EagleRequest, first: int, count: int) -> torch.Tensor:
        """h_{first} .. h_{first+count-1} from the kept features, zeros where there are
        none (position -1, or features the target never computed)."""
        out = torch.zeros(count, self.hidden_size, dtype=self.model.dtype, device=self.device)
        feats = self._features.get(ereq.request_id)
        if feats is not None:
            lo = max(first, feats.start)
            hi = min(first + count, feats.end)
            if hi > lo:
                out[lo - first : hi - first] = feats.rows[lo - feats.start : hi - feats.start]
        return out

    def free(self, request_id: str) -> None:
        self._features.pop(request_id, None)
        super().free(request_id)

    # ---- the burst ------------------------------------------------------------------
    def propose(self, items, states):
        drafts: list[list[int]] = [[] for _ in items]
        probs: list[list[torch.Tensor]] = [[] for _ in items]
        active, logits, self._out = self._catch_up(items, states, lambda k: k)
        if logits is not None:
            self._burst(active, logits, states, drafts, probs)
            self._out = None
        draft_probs = [torch.stack(p) if p else None for p in probs]
        return drafts, draft_probs

    def _catch_up(self, items, states, slots):
        """The burst's first forward: each speculating request's draft fed the verified
        tokens it has not seen, with the target's features, ``slots(k)`` - 1 lookahead
        slots reserved for what it drafts after (k: the item's num_spec_tokens).
        Returns (the requests whose catch-up was whole: (item index, draft request, k),
        their rows' logits, the draft's outputs o there), logits and o None when nothing
        was fed."""
        active: list[tuple[int, _EagleRequest, int]] = []
        first: list[SeqInput] = []
        hidden: list[torch.Tensor] = []
        budget = self.max_num_batched_tokens
        self.max_catchup = 0
        for i, (item, state) in enumerate(zip(items, states)):
            request = state.request
            ereq = self._draft_request(request)
            self._settle(ereq)
            self._trim_features(ereq, request.num_computed_tokens)
            if ereq.num_computed_tokens >= ereq.num_tokens:  # nothing new: feed the last again
                ereq.num_computed_tokens = self.kv.rollback(ereq, ereq.num_tokens - 1)
            num_fed = self._reserve(ereq, slots(item.num_spec_tokens), budget)
            if not num_fed:
                continue
            budget -= num_fed
            self.max_catchup = max(self.max_catchup, num_fed)
            ereq.num_catchup = num_fed
            whole = ereq.fed_start + num_fed == ereq.num_tokens
            block_ids = self.kv.get_block_ids(ereq.request_id)
            first.append(SeqInput(list(ereq.fed), ereq.fed_start, block_ids, int(whole)))
            hidden.append(self._hidden_for(ereq, ereq.fed_start - 1, num_fed))
            if whole:
                active.append((i, ereq, item.num_spec_tokens))
        if not first:
            return active, None, None
        logits, out = self._forward(first, hidden)
        return active, logits, out

    def _next_logits(self, active, rows, drafts) -> torch.Tensor:
        """Each active request's last draft, with h = the draft's own output at the
        position before (row ``rows[n]`` of the last forward)."""
        feeds = [self._feed(e, drafts[i][-1]) for i, e, _ in active]
        logits, self._out = self._forward(feeds, [self._out[row : row + 1] for row in rows])
        return logits

    @torch.inference_mode()
    def _forward(self, seqs: list[SeqInput], hidden: list[torch.Tensor]):
        """(the reduced head's logits [rows, draft vocab], o [rows, H]) for the rows each
        seq asks for."""
        input_ids, positions, metadata, logit_rows = self.runner.prepare(seqs)
        with set_attention_metadata(metadata):
            out = self.model(input_ids, positions, torch.cat(hidden))
        if logit_rows is not None:
            out = out[logit_rows]
        return self.model.compute_reduced_logits(out), out

    # ---- after verification ---------------------------------------------------------
    def _settle(self, ereq: _EagleRequest) -> None:
        """Keep what the burst's first step fed (verified tokens, target features);
        roll back the drafts."""
        if not ereq.fed:
            return
        keep = min(ereq.fed_start + ereq.num_catchup, ereq.num_tokens)
        ereq.num_computed_tokens = self.kv.rollback(ereq, keep)
        ereq.fed, ereq.num_catchup = [], 0

    def on_verified(self, requests) -> None:
        for request in requests:
            ereq = self._requests.get(request.request_id)
            if ereq is not None and ereq.fed:
                self._settle(ereq)
                self._trim_features(ereq, request.num_computed_tokens)
