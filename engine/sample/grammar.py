"""Structured output: a grammar matcher per constrained request (llguidance), the masks
verification needs, and a cache of compiled constraints.

The target distribution under a constraint is the model's, masked to the tokens the
constraint allows at that point and renormalized. With speculation that must hold at
every verified position: a request's drafts are cut at the first token the constraint
refuses (a draft model's just after it, so that rejection sampling draws from the
residual), its ``1 + k`` rows each get the mask of the state after the drafts before
them (the matcher advances through the drafts and rolls back), and after verification
it advances by the tokens the request kept. Where the constraint allows exactly one
token (a JSON skeleton: ``{"name": "``), those tokens are forced: they go into the
batch as drafts that verification cannot reject (their masked probability is 1), so
a skeleton costs one forward, not one per token.

A constraint can fail mid-output: llguidance's matcher enters an error state it never
leaves (an ambiguous grammar past the parser's limits, a refusal of a token its own mask
allowed), or the matcher takes longer than the step budget. A failed ``Grammar`` turns
inert (it allows everything and consumes nothing) and records why; the engine ends that
request after the step (finish_reason "error"), its output cut at the last token the
matcher took. Nothing a constraint does raises into the engine's step.

llguidance (PyPI, a Rust library with no dependencies) is the backend: it compiles
JSON schemas, regexes, Lark and GBNF grammars and structural tags lazily (a matcher
costs milliseconds to make), computes a mask in tens of microseconds, and rolls back.
xgrammar, the other candidate, requires triton on Linux x86-64 (a 286 MB wheel that a
CPU server never uses).
"""

from __future__ import annotations

import functools
import gc
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine import envs
from engine.io.sampling_params import StructuredOutput
from engine.kernels.cpu import cpu_kernels
from engine.spec_decode import paths

# Bits of one mask word; a mask is ceil(vocab / 32) int32 words, bit t % 32 of word
# t // 32 set when token t is allowed.
_BITS = torch.arange(32, dtype=torch.int32)
_MAX_ERROR_CHARS = 300


# JSON as json.dumps writes it: one space after ':' and ',', no other whitespace. A small
# model given free whitespace can spend its whole budget on newlines; and a fixed layout
# makes more of a schema's skeleton forced tokens. A schema's "x-guidance" overrides it.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """A constraint that cannot be compiled: the compiler's message, shortened."""


# A step over the budget is forgiven once in FORGIVE_EVERY_STEPS steps of a request,
# if it is within HARD_BUDGET_FACTOR times the budget and the step before it took under
# 1 / FORGIVE_AFTER_FRACTION of it (GrammarLimits says why).
FORGIVE_EVERY_STEPS = 64
HARD_BUDGET_FACTOR = 10
FORGIVE_AFTER_FRACTION = 10


class _Failed(Exception):
    """A matcher call failed (raised inside Grammar only; the message is why)."""


@dataclass(frozen=True)
class GrammarLimits:
    """What one request's constraint may cost the engine.

    ``step_budget_ms``: the CPU time its matcher may take in one engine step (forced
    tokens, draft checks, masks, advancing; on whichever thread computes them; Python's
    garbage collections that happen to run inside a matcher call do not count); a
    request over it ends with an error, except that a spike is forgiven once in
    ``FORGIVE_EVERY_STEPS`` steps: a step over the budget (within ``HARD_BUDGET_FACTOR``
    times it) after a step under ``1 / FORGIVE_AFTER_FRACTION`` of it. The operating
    system charges a thread's CPU clock with what it spends around it (page reclaim, a
    virtual machine's stolen time), and on a loaded machine a constraint whose masks
    take under 0.4 ms was once charged over 20 ms in one step; a costly grammar is costly
    before it goes over (the hostile one in scripts/bench_hostile_constraint.py takes
    2-8 ms a step between its spikes) and is not forgiven.

    ``max_items``: llguidance's cap on the Earley items of one mask computation
    (``step_max_items``), which bounds a single call the budget can only check after it
    returns."""

    step_budget_ms: float = 20.0  # (both checked by EngineConfig)
    max_items: int = 50_000

    def parser_limits(self):
        from llguidance import LLParserLimits

        # verbose_errors off: an error names the limit, not the parser's state (which
        # quotes the output and the grammar into logs).
        return LLParserLimits(step_max_items=self.max_items, verbose_errors=False)


def to_grammar(constraint: StructuredOutput) -> str:
    """The llguidance grammar of a constraint (not yet checked: compiling checks it)."""
    from llguidance import LLMatcher, StructTag
    from llguidance.gbnf_to_lark import gbnf_to_lark

    kind = constraint.kind
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(constraint.json_schema, defaults=JSON_LAYOUT)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(constraint.regex)
    if kind == "choice":  # string literals in Lark are JSON strings
        options = " | ".join(json.dumps(c) for c in constraint.choice)
        return LLMatcher.grammar_from_lark(f"start: {options}\n")
    if kind == "grammar":
        text = constraint.grammar
        if "::=" in text:  # GBNF, llama.cpp's grammar syntax
            try:
                text = gbnf_to_lark(text)
            except Exception as exc:  # noqa: BLE001 - the converter's message, one line
                raise ConstraintError(f"structured_output.grammar: {_short(exc)}") from None
        return LLMatcher.grammar_from_lark(text)
    return StructTag.to_grammar(_struct_tags(constraint.structural_tag))


def _struct_tags(text: str) -> list:
    """vLLM's structural tag ({"structures": [{"begin", "schema", "end"}], "triggers"})
    as llguidance StructTags: each structure under the trigger its begin starts with."""
    from llguidance import StructTag

    spec = json.loads(text)
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list):
        raise ConstraintError(
            "structured_output.structural_tag must hold a non-empty 'structures' list and a "
            "'triggers' list"
        )
    tags = []
    for i, s in enumerate(structures):
        begin = s.get("begin") if isinstance(s, dict) else None
        trigger = next(
            (t for t in triggers if isinstance(begin, str) and begin.startswith(t)), None
        )
        if not trigger or not isinstance(s.get("end", ""), str):
            raise ConstraintError(
                f"structured_output.structural_tag structures[{i}]: 'begin' must start with "
                "one of 'triggers', and 'end' must be a string"
            )
        tags.append(
            StructTag(
                trigger=trigger, begin=begin, grammar=s.get("schema") or {}, end=s.get("end", "")
            )
        )
    return tags


class GrammarCompiler:
    """Compiles constraints for one tokenizer: a template matcher per constraint, kept in
    a bounded LRU cache; each request gets a copy. Thread-safe: the async engine compiles
    on worker threads (llguidance drops the GIL while it builds a matcher)."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids,
        cache_size: int = 128,
        limits: GrammarLimits | None = None,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.limits = limits or GrammarLimits()
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._cache: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def grammar(self, constraint: StructuredOutput) -> Grammar:
        """A new request's matcher for ``constraint``; ConstraintError when it does not
        compile."""
        matcher = self._template(constraint).deep_copy()
        return Grammar(matcher, self.vocab_size, constraint.kind, self.limits)

    def _template(self, constraint: StructuredOutput):
        with self._lock:
            if constraint in self._cache:
                self._cache.move_to_end(constraint)
                return self._cache[constraint]
        template = self._compile(constraint)
        with self._lock:
            self._cache[constraint] = template
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return template

    def _compile(self, constraint: StructuredOutput):
        from llguidance import LLMatcher

        try:
            grammar = to_grammar(constraint)
        except ConstraintError:
            raise
        except (ValueError, AssertionError) as exc:
            raise ConstraintError(f"structured_output.{constraint.kind}: {_short(exc)}") from None
        matcher = LLMatcher(
            self._tokenizer(), grammar, log_level=0, limits=self.limits.parser_limits()
        )
        if matcher.is_error():
            raise ConstraintError(
                f"structured_output.{constraint.kind}: {_short(matcher.get_error())}"
            )
        return matcher

    def prepare(self) -> None:
        """Make llguidance's view of the tokenizer now (a server does at start, on a
        worker thread) rather than at the first constrained request."""
        self._tokenizer()

    def _tokenizer(self):
        """llguidance's view of the tokenizer, made once (about a second)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._ll_tokenizer


def _inert(answer):
    """A Grammar method that never raises: once the constraint has failed (in this call
    or before), it returns ``answer(self, *args)`` instead. The engine ends a failed
    request after the step, so what its constraint answers until then must only be
    harmless: it allows everything, forces and consumes nothing."""

    def wrap(method):
        @functools.wraps(method)
        def guarded(self, *args):
            if self.failure is None:
                try:
                    return method(self, *args)
                except Exception as exc:  # noqa: BLE001 - a failure ends the request, not the engine
                    self._fail(exc)
            return answer(self, *args)

        return guarded

    return wrap


def _allow_all(self, *args) -> torch.Tensor:
    return torch.full((1, self.num_words), -1, dtype=torch.int32)


def _allow_all_rows(self, drafts, parents=None) -> torch.Tensor:
    return torch.full((1 + len(drafts), self.num_words), -1, dtype=torch.int32)


class _GcClock(threading.local):
    """The CPU time Python's garbage collector has taken on this thread. A collection
    runs inside whichever call allocates when a generation fills up, a matcher call
    among them; with thousands of requests alive a full one takes 100+ ms, which is not
    the constraint's cost and must not end its request."""

    seconds = 0.0
    started: float | None = None


_GC_CLOCK = _GcClock()


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _GC_CLOCK.started = time.thread_time()
    elif _GC_CLOCK.started is not None:
        _GC_CLOCK.seconds += time.thread_time() - _GC_CLOCK.started
        _GC_CLOCK.started = None


gc.callbacks.append(_on_gc)


class Grammar:
    """One constrained request's matcher, at the end of its verified tokens."""

    __slots__ = (
        "_matcher",
        "_vocab_size",
        "_kind",
        "_budget_s",
        "num_consumed",
        "dead_rows",
        "dead_end_at",
        "failure",
        "step_seconds",
        "_steps",
        "_forgiven_at",
        "_last_step_seconds",
    )

    def __init__(
        self, matcher, vocab_size: int, kind: str = "grammar", limits: GrammarLimits | None = None
    ) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._kind = kind
        self._budget_s = (limits or GrammarLimits()).step_budget_ms / 1e3
        self.num_consumed = 0  # output tokens the matcher has consumed
        # This step's verified rows that allowed nothing (EOS was put there), by row;
        # after verification (keep_dead_rows), by the output position of the rows the
        # output kept; and the one the request's output reached: a dead end.
        self.dead_rows: set[int] = set()
        self.dead_end_at: int | None = None
        # Why the constraint failed (one line naming it), or None; the matcher's CPU
        # time in the current engine step.
        self.failure: str | None = None
        self.step_seconds = 0.0
        self._steps = 0  # engine steps so far (start_step)
        self._forgiven_at: int | None = None  # the step whose overrun was forgiven
        self._last_step_seconds = 0.0  # the step before this one's CPU time

    @property
    def num_words(self) -> int:
        return -(-self._vocab_size // 32)

    def start_step(self) -> None:
        """A new engine step: the budget starts again."""
        self._last_step_seconds, self.step_seconds = self.step_seconds, 0.0
        self._steps += 1

    def _call(self, fn, *args):
        """``fn(*args)`` on the matcher, timed against the step budget; raises _Failed
        when the matcher is in its error state after it or the budget is spent."""
        start, collected = time.thread_time(), _GC_CLOCK.seconds
        try:
            return fn(*args)
        finally:
            spent = time.thread_time() - start - (_GC_CLOCK.seconds - collected)
            self.step_seconds += max(0.0, spent)
            if self._matcher.is_error():
                raise _Failed(self._matcher.get_error())
            self._check_budget()

    def _check_budget(self) -> None:
        """Raises _Failed when this step's CPU time is over the budget, unless this is
        the one step over it that GrammarLimits forgives."""
        now, budget = self.step_seconds, self._budget_s
        if now <= budget:
            return
        limit = f"limit {1e3 * budget:g} ms a step, --structured-output-step-budget-ms"
        if now > HARD_BUDGET_FACTOR * budget:
            raise _Failed(
                f"its matcher took {1e3 * now:.0f} ms of CPU time in one engine step "
                f"(over {HARD_BUDGET_FACTOR} times the {limit})"
            )
        if self._forgiven_at == self._steps:
            return  # the step forgiven, still within ten budgets
        before = self._last_step_seconds
        if before >= budget / FORGIVE_AFTER_FRACTION:
            raise _Failed(
                f"its matcher took {1e3 * now:.0f} ms of CPU time in one engine step, "
                f"after {1e3 * before:.1f} ms in the step before ({limit})"
            )
        last = self._forgiven_at
        if last is not None and self._steps - last < FORGIVE_EVERY_STEPS:
            raise _Failed(
                f"its matcher took {1e3 * now:.0f} ms of CPU time in one engine step, "
                f"{self._steps - last} steps after another step over the limit ({limit})"
            )
        self._forgiven_at = self._steps

    def _fail(self, exc: Exception) -> None:
        reason = str(exc).split("<state>")[0].replace("<non-verbose/>", "").strip()
        self.failure = _short(
            f"structured_output.{self._kind} failed at output token {self.num_consumed}: "
            f"{reason or type(exc).__name__}"
        )

    @_inert(lambda self: [])
    def forced_tokens(self) -> list[int]:
        """Tokens the constraint allows one by one from here, whatever the model says."""
        return list(self._call(self._matcher.compute_ff_tokens))

    @_inert(lambda self, tokens: [])
    def forced_after(self, tokens: list[int]) -> list[int]:
        """The tokens the constraint forces after ``tokens`` (all of which it accepts)."""
        recorded = self._consume_all(tokens)
        try:
            return list(self._call(self._matcher.compute_ff_tokens))
        finally:
            self._call(self._matcher.rollback, recorded)

    @_inert(lambda self, tokens: 0)
    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the constraint accepts in a row from here."""
        return int(self._call(self._matcher.validate_tokens, tokens)) if tokens else 0

    @_inert(_allow_all_rows)
    def masks(
        self, drafts: list[int], parents: list[int] | None = None
    ) -> torch.Tensor:  # [1 + len(drafts), words] int32
        """The mask of each verified row: here, and after each draft (for a token tree,
        after each node's path). A chain's drafts are ``allowed_prefix`` of them,
        perhaps with the first refused one last: the row after that one allows
        everything, as it is never reached (the refused draft's own row has p = 0 for
        it, so verification rejects it). A tree's nodes are all allowed (``constrain``
        pruned the others)."""
        if parents is not None:
            return self._tree_masks(drafts, parents)
        num_allowed = self.allowed_prefix(drafts)  # never consume a refused token:
        if num_allowed < len(drafts) - 1:  # it leaves the matcher in its error state
            raise RuntimeError(f"a refused draft before the last reached masks(): {drafts}")
        rows = [self._mask()]
        recorded = 0
        try:
            for token in drafts[:num_allowed]:
                recorded += self._consume(token)
                rows.append(self._mask())
        finally:
            self._call(self._matcher.rollback, recorded)
        if num_allowed < len(drafts):
            rows.append(torch.full_like(rows[0], -1))  # every bit set
        return torch.stack(rows)

    def _tree_masks(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """Each row's mask, walking the tree depth first."""
        rows: list[torch.Tensor | None] = [None] * (1 + len(tokens))

        def at_row(row: int) -> None:
            rows[row] = self._mask()

        self._walk(tokens, parents, at_row, lambda node: True)
        return torch.stack(rows)

    @_inert(lambda self, tokens, parents: [True] * len(tokens))
    def allowed_nodes(self, tokens: list[int], parents: list[int]) -> list[bool]:
        """Which nodes of a token tree the constraint allows, their path included."""
        allowed = [False] * len(tokens)

        def admit(node: int) -> bool:
            ok = self._call(self._matcher.validate_tokens, [tokens[node]]) == 1
            allowed[node] = ok
            return ok

        self._walk(tokens, parents, lambda row: None, admit)
        return allowed

    def _walk(self, tokens: list[int], parents: list[int], at_row, admit) -> None:
        """Depth first over a token tree with the matcher following along: ``at_row(row)``
        with the matcher after that row's path; a node is entered when ``admit(node)``
        (asked with the matcher at its parent), consumed once and rolled back once."""
        children = paths.children(parents)

        def visit(row: int) -> None:
            at_row(row)
            for node in children[row]:
                if not admit(node):
                    continue
                recorded = self._consume(tokens[node])
                try:
                    visit(node + 1)
                finally:
                    self._call(self._matcher.rollback, recorded)

        visit(0)

    def keep_dead_rows(self, rows: list[int], num_output_tokens: int) -> None:
        """After verification: ``rows`` are the rows whose samples the output kept, in
        order (the first at output position ``num_output_tokens``); the dead rows among
        them become output positions (``advance`` reads them), the others were never
        reached."""
        dead = self.dead_rows
        self.dead_rows = {num_output_tokens + k for k, row in enumerate(rows) if row in dead}

    def _consume(self, token: int) -> int:
        """Consume one token the constraint accepts; returns 1 if the matcher recorded it
        (what rollback counts), 0 if it had stopped already: once a constraint is
        complete and nothing may extend it, the matcher takes the EOS that ends the
        output without a record, and a rollback counting that EOS would undo one token
        too many."""
        if self._matcher.is_stopped():
            return 0
        if not self._call(self._matcher.consume_token, token):
            raise _Failed(f"the matcher refused a token it validated: {token}")
        return 1

    def _consume_all(self, tokens: list[int]) -> int:
        """``_consume`` for each of ``tokens``; returns the count a rollback undoes."""
        recorded = 0
        for token in tokens:
            recorded += self._consume(token)
        return recorded

    @_inert(lambda self, prefix, token: True)
    def allows_after(self, prefix: list[int], token: int) -> bool:
        """Whether the constraint allows ``token`` after ``prefix`` (which it accepts)."""
        return int(self._call(self._matcher.validate_tokens, [*prefix, token])) == len(prefix) + 1

    @_inert(_allow_all)
    def mask_after(self, prefix: list[int]) -> torch.Tensor:  # [1, words] int32
        """The mask of the position after ``prefix`` (all of which the constraint accepts)."""
        recorded = self._consume_all(prefix)
        try:
            return self._mask().unsqueeze(0)
        finally:
            self._call(self._matcher.rollback, recorded)

    def _mask(self) -> torch.Tensor:
        words = self._call(self._matcher.compute_bitmask)
        return torch.frombuffer(bytearray(words), dtype=torch.int32)

    @_inert(lambda self, output_token_ids: None)
    def advance(self, output_token_ids: list[int]) -> None:
        """Consume the output tokens not yet consumed (the verified ones)."""
        new = output_token_ids[self.num_consumed :]
        last = len(output_token_ids) - 1
        if self.dead_rows and last in self.dead_rows and self.dead_end_at is None:
            self.dead_end_at = last  # its token is the EOS a dead row allowed alone
            new = new[:-1]
        # A stopped matcher (complete, nothing may extend it) takes no more tokens: its
        # mask allowed the EOS that ends the output alone.
        stopped = self._matcher.is_stopped()
        if new and not stopped and not self._call(self._matcher.consume_tokens, new):
            raise _Failed(f"the matcher refused verified tokens: {new}")
        self.num_consumed = len(output_token_ids)
        self.dead_rows.clear()

    @property
    def is_complete(self) -> bool:
        """Whether the output so far satisfies the constraint (it may end here)."""
        return self.failure is None and bool(self._matcher.is_accepting())


def apply_masks(
    logits: torch.Tensor,  # [sum(1 + drafts), vocab], adjusted, modified in place
    states: list,
    drafts: list[list[int]],
    masks: dict[str, torch.Tensor],  # request id -> [1 + drafts, words] int32
    eos_token_id: int,
    parents: list[list[int] | None] | None = None,  # unused: a tree's masks are per row
) -> None:
    """-inf where the constraint refuses a token. A row that allows nothing (the
    constraint's tokens all masked by min_tokens or stop-token rules: a dead end) gets
    EOS alone, and its request records which (Grammar.dead_rows)."""
    kernels = cpu_kernels() if logits.is_cpu and logits.dtype is torch.float32 else None
    offset = 0
    with torch.inference_mode():  # the model's logits are inference tensors
        for state, draft in zip(states, drafts):
            rows = 1 + len(draft)
            mask = masks.get(state.request.request_id)
            if mask is not None:  # a view: filled in place
                _mask_rows(logits[offset : offset + rows], mask, state, 0, eos_token_id, kernels)
            offset += rows


def _mask_rows(block, mask, state, first: int, eos_token_id: int, kernels) -> bool:
    """``block`` (rows of ``state``'s request from verified row ``first`` on) masked in
    place; a row left with no token gets EOS alone, and the request records which.
    Returns whether any row was."""
    dead = _mask_in_place(block, mask, kernels)
    for row in dead:
        block[row, eos_token_id] = 0.0
        state.grammar.dead_rows.add(first + row)
    return bool(dead)


def _mask_in_place(block, mask, kernels) -> list[int]:
    """``mask_logits`` on ``block``, in one C pass where the kernels serve it (~20x the
    torch ops)."""
    return kernels.mask_logits(block, mask) if kernels is not None else mask_logits(block, mask)


def uses_lazy_masks(params) -> bool:
    """Greedy rows are masked only where the constraint refuses their argmax
    (``apply_greedy_masks``): masking cannot move an argmax the constraint allows."""
    return params.is_greedy and envs.lazy_greedy_masks()


def apply_greedy_masks(
    logits: torch.Tensor,  # [sum(1 + drafts), vocab], adjusted, modified in place
    states: list,
    drafts: list[list[int]],
    eos_token_id: int,
    parents: list[list[int] | None] | None = None,  # per request: a tree's, or None
) -> int:
    """The masks of greedy constrained requests' rows, computed only where needed: a row
    whose argmax the constraint allows keeps that argmax under the mask (the first
    maximal index overall is the first among the allowed), so only rows whose argmax it
    refuses (or is not finite) get their mask, and a request's rows are those greedy
    verification reads: from the root, the row of the draft (the tree's node) holding
    each row's token, until there is none. Returns the number of masks computed."""
    parents = parents or [None] * len(drafts)
    spans, offset = [], 0
    for state, draft, tree in zip(states, drafts, parents):
        if getattr(state, "grammar", None) is not None and uses_lazy_masks(state.params):
            spans.append((state, draft, tree, offset))
        offset += 1 + len(draft)
    if not spans:
        return 0
    rows = torch.tensor([o + j for _, d, _, o in spans for j in range(1 + len(d))])
    with torch.inference_mode():
        best, argmax = logits[rows].max(dim=-1)
    best, argmax = torch.isfinite(best).tolist(), argmax.tolist()
    kernels = cpu_kernels() if logits.is_cpu and logits.dtype is torch.float32 else None
    num_masks = at = 0
    for state, draft, tree, offset in spans:
        grammar, num_rows = state.grammar, 1 + len(draft)
        if tree is None:
            # Rows after a refused draft (a draft model's, kept for the residual) are
            # never read.
            num_allowed = grammar.allowed_prefix(draft)
            tree = list(range(-1, num_allowed - 1))
            draft = draft[:num_allowed]
        children = {(parent, token): i for i, (parent, token) in enumerate(zip(tree, draft))}
        prefixes = paths.row_prefixes(draft, tree)
        row = 0
        while True:
            token = argmax[at + row]
            if not (best[at + row] and grammar.allows_after(prefixes[row], token)):
                block = logits[offset + row : offset + row + 1]
                mask = grammar.mask_after(prefixes[row])
                num_masks += 1
                with torch.inference_mode():
                    if _mask_rows(block, mask, state, row, eos_token_id, kernels):
                        break  # a dead row: its EOS ends the output
                    token = int(block.argmax())
            node = children.get((row - 1, token))
            if node is None:
                break
            row = node + 1
        at += num_rows
    return num_masks


def mask_draft_logits(logits: torch.Tensor, rows: list) -> list[int]:
    """A draft burst's constrained rows under their constraint (in place): ``rows`` are
    (row of ``logits``, Grammar, the request's drafts so far, greedy) and each row gets
    the mask after those drafts, as the verifier masks that position. A greedy row whose
    argmax the constraint allows keeps it, so it needs no mask (``apply_greedy_masks``).
    Returns the rows the constraint allows nothing in (their request drafts no more)."""
    kernels = cpu_kernels() if logits.is_cpu and logits.dtype is torch.float32 else None
    dead = []
    with torch.inference_mode():
        for row, grammar, prefix, greedy in rows:
            block = logits[row : row + 1]
            if greedy:
                best, token = block.max(dim=-1)
                if bool(torch.isfinite(best)) and grammar.allows_after(prefix, int(token)):
                    continue
            if _mask_in_place(block, grammar.mask_after(prefix), kernels):
                dead.append(row)
    return dead


def mask_logits(logits: torch.Tensor, masks: torch.Tensor) -> list[int]:
    """In place: -inf where ``masks`` ([rows, words] int32) refuses a token or the logit
    is not finite. Returns the rows left with no token (torch ops: any device, dtype)."""
    allowed = allowed_tokens(masks.to(logits.device), logits.shape[-1]) & torch.isfinite(logits)
    logits.masked_fill_(~allowed, float("-inf"))
    return (~allowed.any(dim=-1)).nonzero().flatten().tolist()


def allowed_tokens(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, words] int32 masks -> [n, vocab_size] bool: True where the token is allowed."""
    bits = (masks.unsqueeze(-1) >> _BITS) & 1  # [n, words, 32]
    return bits.reshape(masks.shape[0], -1)[:, :vocab_size].bool()


def _short(error: object) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."
