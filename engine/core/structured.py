"""The step's structured-output work, for the requests that carry a constraint
(engine/sample/grammar.py has the matcher; LLMEngine.step calls these in order):

    before schedule   forced_counts   how many tokens each constraint forces from here:
                                      the scheduler grants that many lookahead slots
    in the burst      (proposer)      a draft model drafts under the mask after its drafts
                                      so far (DraftModelProposer._masked), as verification
                                      masks that position
    after propose     constrain       drafts: the forced tokens, else the proposer's cut at
                                      the first token the constraint refuses (n-gram), a
                                      token tree's refused nodes pruned
    beside forward    MaskBuilder     one mask per verified row (1 + drafts per request),
                                      computed on a worker thread while the model runs;
                                      the verifier applies them (sample/grammar.py);
                                      greedy rows are masked by the verifier, and only
                                      where the constraint refuses their argmax
    after update      advance         each matcher consumes the tokens its request kept
                      failed          the requests whose constraint failed this step: the
                                      engine ends them ("error"), nobody else

A constraint's matcher is timed against its step budget from forced_counts on
(Grammar.start_step).

The order of logit processing is documented on SamplingParams: penalties, logit bias and
min_tokens, then the constraint's mask, then temperature and the filters.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from engine import envs
from engine.io.sampling_params import MAX_NUM_SPECULATIVE_TOKENS
from engine.sample.grammar import uses_lazy_masks
from engine.spec_decode import paths

# Lookahead slots a constrained request gets past its k when it speculates with n-gram
# drafts: the tokens its constraint forces after the drafts (a value's closing quote,
# then `, "next_key": "`) go into the same verification. Used when the drafts allow it.
FORCED_TAIL_SLOTS = 8

INCOMPLETE = (
    "structured output incomplete: max_tokens ended the output before the constraint was complete"
)
DEAD_END = (
    "structured output dead end: the constraint allowed no token at output position {} "
    "(min_tokens or stop_token_ids masked all it allowed); the output ends with EOS there"
)


def forced_counts(states) -> dict[str, list[int]]:
    """Each decoding constrained request's forced tokens (empty lists left out); sets
    ``request.num_forced_tokens`` for the scheduler."""
    forced = {}
    enabled = envs.forced_tokens()
    for state in states:
        grammar, request = state.grammar, state.request
        if grammar is None:
            continue
        grammar.start_step()
        decoding = request.num_computed_tokens == request.num_tokens - 1
        tokens = (
            grammar.forced_tokens()[:MAX_NUM_SPECULATIVE_TOKENS] if decoding and enabled else []
        )
        request.num_forced_tokens = len(tokens)
        if tokens:
            forced[request.request_id] = tokens
    return forced


def constrain(sched, states: dict, forced: dict[str, list[int]], draft_probs: dict) -> None:
    """Cut every constrained request's drafts to what the constraint allows: its forced
    tokens when it has some (they need no proposer, and verification keeps them all),
    else the proposer's drafts up to the first one refused (n-gram), or up to and with
    it (drawn from a draft model's q, see below). ``draft_probs`` (the draft model's q
    per request) loses the rows of drafts dropped; forced drafts are deterministic, so
    they have none (one-hot q)."""
    for item in sched.scheduled:
        state = states.get(item.request_id)
        if state is None or state.grammar is None or not item.needs_sample:
            continue
        drafts = item.spec_token_ids
        if item.spec_parents is not None and item.request_id not in forced:
            # A token tree (deterministic nodes): the nodes the constraint refuses go,
            # with everything below them; no forced tail rides along.
            allowed = state.grammar.allowed_nodes(drafts, item.spec_parents)
            kept, item.spec_parents = paths.keep_nodes(drafts, item.spec_parents, allowed)
            item.num_scheduled_tokens += len(kept) - len(drafts)
            item.spec_token_ids = kept
            continue
        item.spec_parents = None  # forced tokens are a chain
        if item.request_id in forced:
            kept = forced[item.request_id][: item.num_spec_tokens]
            draft_probs.pop(item.request_id, None)
        else:
            grammar = state.grammar
            num_allowed = grammar.allowed_prefix(drafts)
            if item.request_id in draft_probs:
                # A draft model draws under the mask, so none of its drafts is refused;
                # were one, it keeps its first refused token: verification then
                # rejects it for certain (its masked p is 0) and draws from the residual
                # max(0, p - q), which is what keeps rejection sampling exact. Cutting it
                # would draw from p instead, and p is not the residual: outputs would
                # lean towards what the draft model likes.
                kept = drafts[: num_allowed + 1]
                draft_probs[item.request_id] = draft_probs[item.request_id][: len(kept)]
            else:  # a deterministic draft (n-gram): refused means p(d) = 0, the residual is p
                kept = drafts[:num_allowed]
                room = item.num_spec_tokens + item.num_tail_slots - len(kept)
                if kept and room > 0:  # what the constraint forces after them rides along
                    tail = grammar.forced_after(kept)[:room]
                    item.num_forced_tail = len(tail)
                    kept = kept + tail
        item.num_scheduled_tokens += len(kept) - len(drafts)
        item.spec_token_ids = list(kept)


class MaskBuilder:
    """Computes the masks of a step on a worker thread, beside the forward (llguidance
    drops the GIL while it computes; the forward's torch ops drop it too)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")

    def start(
        self, states: list, drafts: list[list[int]], parents: list[list[int] | None]
    ) -> Future | None:
        """Masks per constrained request id ([1 + drafts, words]: one per row, a token
        tree's by node), or None if none. Greedy requests' masks are left to the
        verifier (sample/grammar.py, ``apply_greedy_masks``), which computes only those
        it needs."""
        work = [
            (s.request.request_id, s.grammar, d, p)
            for s, d, p in zip(states, drafts, parents)
            if s.grammar is not None and not uses_lazy_masks(s.params)
        ]
        if not work:
            return None
        return self._pool.submit(lambda: {rid: g.masks(d, p) for rid, g, d, p in work})

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def advance(changed, states: dict) -> None:
    """Each constrained request's matcher consumes the output tokens it kept."""
    for request in changed:
        state = states.get(request.request_id)
        if state is not None and state.grammar is not None:
            state.grammar.advance(request.output_token_ids)


def failed(states) -> list:
    """The constrained requests whose constraint failed (Grammar.failure says why)."""
    return [s for s in states if s.grammar is not None and s.grammar.failure is not None]


def finish_detail(state) -> str | None:
    """Why a constrained request's output may not satisfy its constraint, or None."""
    grammar = state.grammar
    if grammar is None:
        return None
    if grammar.failure is not None:
        return grammar.failure
    if grammar.dead_end_at is not None:
        return DEAD_END.format(grammar.dead_end_at)
    if state.request.finish_reason == "length" and not grammar.is_complete:
        return INCOMPLETE
    return None
