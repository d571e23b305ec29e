"""Suffix decoding: token trees from what followed the request's latest tokens before,
in its own prompt and output and in recent answers of the same caller.

Microservice traffic repeats itself: a template filled with other fields, the same
extraction over many inputs, retries, a conversation's history quoted back. Suffix
decoding (Oliaro et al., "SuffixDecoding", NeurIPS 2025) caches that text and, at each
step, looks up the longest suffix of the request's context that occurred before; every
earlier occurrence continues somehow, and those continuations, merged into a tree and
weighted by how many occurrences take each branch, are the draft. It needs no model
and costs a few dict reads per step.

How this implementation finds the occurrences. A ``SuffixText`` is a token sequence
with two indexes: where every token ends up (1-grams) and where every 4-gram ends, each
a list of positions in order. The lookup takes the occurrences of the context's last
4 tokens (else of its last token), most recent first, extends each match backwards
token by token up to ``max_match``, and keeps the occurrences of the longest match
(SuffixDecoding's suffix tree node: the occurrences sharing the longest suffix). Their
continuations make a trie with a count per node; a node's score is the product down its
path of ``count(child) / (count(parent) + c)``, ``c`` a pseudo-count that shrinks as the
match grows (a 16-token match is more telling than a 4-token one), so a single earlier
occurrence still scores below 1 and deeper nodes score less. The tree is the best
``max_nodes`` nodes by score, taken best first, its size capped at ``alpha`` times the
match length (SuffixDecoding's adaptive speculation length).

The per-request text is the request's prompt and output, extended as tokens are
verified. The cache of recent answers holds finished requests' text (the end of the
prompt, where the answer's first tokens are matched, and the output) per scope (the
caller's API key id: how fast a guess is accepted could otherwise reveal another
caller's text), the oldest evicted first once the estimated memory of all scopes passes
``max_cache_bytes``.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.spec_decode.draft_tree import DraftTree

# Index key lengths: a 4-gram match, else a 1-token one.
LONG_KEY = 4
# Occurrences of a key considered per lookup, most recent first.
MAX_CANDIDATES = 48
# The most tokens of a finished request's prompt kept with its answer.
PROMPT_TAIL = 64
# Requests whose own index is kept; the least recently used beyond this is rebuilt.
MAX_INDEXED_REQUESTS = 256
# What one cached token costs, estimated: its int in the token list and its two index
# entries (a position in a list, and its share of dict keys and lists), CPython 3.11.
BYTES_PER_TOKEN = 160


@dataclass(slots=True)
class _Segment:
    """One cached answer: its tokens live in its scope's text at [start, end)."""

    scope: str | None
    start: int
    end: int
    alive: bool = True


class SuffixText:
    """A growing token sequence with its 1-gram and 4-gram indexes: key -> positions
    where the key ends (the index of the token after it), oldest first."""

    __slots__ = ("tokens", "ones", "fours", "length", "floor")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.ones: dict[int, deque[int]] = {}
        self.fours: dict[tuple[int, ...], deque[int]] = {}
        self.length = 0  # tokens indexed
        self.floor = 0  # positions below this belong to evicted text

    def extend(self, tokens: Sequence[int]) -> None:
        """Index ``tokens`` appended after what is there."""
        self.tokens.extend(tokens)
        self.index_to(len(self.tokens))

    def index_to(self, end: int) -> None:
        """Index the tokens up to ``end`` (self.tokens may be a request's own list,
        grown by others)."""
        tokens, ones, fours = self.tokens, self.ones, self.fours
        for pos in range(self.length, end):
            ones.setdefault(tokens[pos], deque()).append(pos + 1)
            if pos >= LONG_KEY - 1:
                key = tuple(tokens[pos - LONG_KEY + 1 : pos + 1])
                fours.setdefault(key, deque()).append(pos + 1)
        self.length = max(self.length, end)

    def occurrences(self, context: Sequence[int], limit: int) -> tuple[list[int], int]:
        """(positions right after up to ``limit`` earlier occurrences of the context's
        tail, most recent first; the key length matched), ([], 0) when none."""
        if len(context) >= LONG_KEY:
            found = self.fours.get(tuple(context[-LONG_KEY:]))
            if found:
                return self._recent(found, limit), LONG_KEY
        if context:
            found = self.ones.get(context[-1])
            if found:
                return self._recent(found, limit), 1
        return [], 0

    def _recent(self, found: deque[int], limit: int) -> list[int]:
        while found and found[0] <= self.floor:  # evicted text: dropped as met
            found.popleft()
        out = []
        for pos in reversed(found):
            out.append(pos)
            if len(out) == limit:
                break
        return out


class _Trie:
    """Continuations merged: node 0 is the root; children by (node, token)."""

    __slots__ = ("children", "counts", "tokens", "parents")

    def __init__(self) -> None:
        self.children: dict[tuple[int, int], int] = {}
        self.counts = [0]
        self.tokens = [-1]
        self.parents = [-1]

    def add(self, continuation: Sequence[int]) -> None:
        node = 0
        self.counts[0] += 1
        for token in continuation:
            child = self.children.get((node, token))
            if child is None:
                child = self.children[(node, token)] = len(self.counts)
                self.counts.append(0)
                self.tokens.append(token)
                self.parents.append(node)
            self.counts[child] += 1
            node = child


@dataclass(slots=True)
class _Match:
    length: int
    sources: list[tuple[SuffixText, int, int]] = field(default_factory=list)  # text, pos, end


class SuffixDecoder:
    def __init__(
        self,
        max_cache_bytes: int = 64 << 20,
        max_match: int = 32,
        alpha: float = 2.0,
        min_match: int = 1,
    ) -> None:
        if max_cache_bytes < 0:
            raise ValueError(f"max_cache_bytes must be >= 0, got {max_cache_bytes}")
        self.max_cache_bytes = max_cache_bytes
        self.max_match = max_match
        self.alpha = alpha
        self.min_match = min_match
        self._requests: OrderedDict[str, tuple[list[int], SuffixText]] = OrderedDict()
        self._scopes: dict[str | None, SuffixText] = {}
        self._segments: deque[_Segment] = deque()  # oldest first, every scope
        self._scope_segments: dict[str | None, list[_Segment]] = {}
        self.cache_tokens = 0  # tokens of the live cached answers, all scopes
        self.last_match_length = 0  # of the latest propose (0: nothing matched)

    # ---- the cache of recent answers -------------------------------------------------
    @property
    def cache_bytes(self) -> int:
        """The estimated memory of the cached answers (BYTES_PER_TOKEN each)."""
        return self.cache_tokens * BYTES_PER_TOKEN

    def add_finished(
        self, token_ids: Sequence[int], scope: str | None, num_prompt: int = 0
    ) -> None:
        """Cache a finished request's text (the last PROMPT_TAIL tokens of its prompt,
        the first ``num_prompt`` of ``token_ids``, and its output) for ``scope``."""
        tokens = list(token_ids[max(0, num_prompt - PROMPT_TAIL) :])
        if len(tokens) < 2 or len(tokens) * BYTES_PER_TOKEN > self.max_cache_bytes:
            return
        text = self._scopes.get(scope)
        if text is None:
            text = self._scopes[scope] = SuffixText()
        start = len(text.tokens)
        text.extend(tokens)
        segment = _Segment(scope, start, len(text.tokens))
        self._segments.append(segment)
        self._scope_segments.setdefault(scope, []).append(segment)
        self.cache_tokens += len(tokens)
        while self.cache_bytes > self.max_cache_bytes:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        segment = self._segments.popleft()
        segment.alive = False
        self.cache_tokens -= segment.end - segment.start
        text = self._scopes[segment.scope]
        text.floor = segment.end
        live = [s for s in self._scope_segments[segment.scope] if s.alive]
        self._scope_segments[segment.scope] = live
        if not live:
            del self._scopes[segment.scope], self._scope_segments[segment.scope]
        elif segment.end > len(text.tokens) // 2:
            self._compact(segment.scope)

    def _compact(self, scope: str | None) -> None:
        """Rebuild a scope's text from its live answers once half of it is evicted:
        the dead half's tokens and index entries go."""
        old = self._scopes[scope]
        text = self._scopes[scope] = SuffixText()
        for segment in self._scope_segments[scope]:
            start = len(text.tokens)
            text.extend(old.tokens[segment.start : segment.end])
            segment.start, segment.end = start, len(text.tokens)

    def _segment_end(self, scope: str | None, pos: int) -> int:
        """The end of the cached answer holding position ``pos`` of the scope's text."""
        segments = self._scope_segments[scope]
        lo, hi = 0, len(segments)
        while lo < hi:
            mid = (lo + hi) // 2
            if segments[mid].end <= pos:
                lo = mid + 1
            else:
                hi = mid
        return segments[lo].end if lo < len(segments) else pos

    # ---- per request -----------------------------------------------------------------
    def _own(self, request_id: str, token_ids: list[int]) -> SuffixText:
        entry = self._requests.get(request_id)
        if entry is None or entry[0] is not token_ids or len(token_ids) < entry[1].length:
            text = SuffixText()
            text.tokens = token_ids  # the request's own list: indexed as it grows
            entry = self._requests[request_id] = (token_ids, text)
            if len(self._requests) > MAX_INDEXED_REQUESTS:
                self._requests.popitem(last=False)
        self._requests.move_to_end(request_id)
        text = entry[1]
        # the last token has no continuation yet: index up to it (its 1-gram and 4-gram
        # end at len - 1 + 1 = len, pointing past the text)
        text.index_to(len(token_ids) - 1)
        return text

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    # ---- proposing -------------------------------------------------------------------
    def propose(
        self,
        request_id: str,
        token_ids: list[int],
        scope: str | None,
        max_nodes: int,
        max_depth: int,
    ) -> DraftTree:
        """A tree of up to ``max_nodes`` nodes, ``max_depth`` deep, continuing
        ``token_ids`` (the request's prompt and output, growing call to call)."""
        self.last_match_length = 0
        if max_nodes <= 0 or max_depth <= 0 or len(token_ids) < 2:
            return DraftTree()
        own = self._own(request_id, token_ids)
        match = _Match(0)
        self._collect(match, own, token_ids, len(token_ids))
        cached = self._scopes.get(scope)
        if cached is not None:
            self._collect(match, cached, token_ids, None, scope)
        if match.length < self.min_match:
            return DraftTree()
        self.last_match_length = match.length
        trie = _Trie()
        for text, pos, end in match.sources:
            trie.add(text.tokens[pos : min(end, pos + max_depth)])
        budget = min(max_nodes, max(1, math.ceil(self.alpha * match.length)))
        return _best_first(trie, budget, pseudo_count=4.0 / match.length)

    def _collect(
        self,
        match: _Match,
        text: SuffixText,
        context: Sequence[int],
        end: int | None,
        scope: str | None = None,
    ) -> None:
        """Add ``text``'s occurrences of the context's longest suffix to ``match``
        (replacing what it holds if these match longer). ``end``: where continuations
        stop (the request's own text), None for the cache (each answer's own end)."""
        positions, key = text.occurrences(context, MAX_CANDIDATES)
        n = len(context)
        tokens = text.tokens
        for pos in positions:
            stop = end if end is not None else self._segment_end(scope, pos)
            if pos >= stop:
                continue  # no continuation
            length = key
            floor = text.floor if end is None else 0
            if end is None:  # a cached answer: the match stays inside it
                floor = max(floor, self._segment_start(scope, pos))
            while (
                length < self.max_match
                and pos - length - 1 >= floor
                and n - length - 1 >= 0
                and tokens[pos - length - 1] == context[n - length - 1]
            ):
                length += 1
            if length > match.length:
                match.length, match.sources = length, [(text, pos, stop)]
            elif length == match.length:
                match.sources.append((text, pos, stop))

    def _segment_start(self, scope: str | None, pos: int) -> int:
        segments = self._scope_segments[scope]
        lo, hi = 0, len(segments)
        while lo < hi:
            mid = (lo + hi) // 2
            if segments[mid].end <= pos:
                lo = mid + 1
            else:
                hi = mid
        return segments[lo].start if lo < len(segments) else pos


def _best_first(trie: _Trie, max_nodes: int, pseudo_count: float) -> DraftTree:
    """The ``max_nodes`` best trie nodes by score, each after its parent."""
    children: dict[int, list[int]] = {}
    for (parent, _), child in trie.children.items():
        children.setdefault(parent, []).append(child)
    tree = DraftTree()
    index = {0: -1}
    scores = {0: 1.0}
    heap: list[tuple[float, int]] = []

    def push(node: int) -> None:
        for child in children.get(node, ()):
            score = scores[node] * trie.counts[child] / (trie.counts[node] + pseudo_count)
            scores[child] = score
            heapq.heappush(heap, (-score, child))

    push(0)
    while heap and len(tree.tokens) < max_nodes:
        neg, node = heapq.heappop(heap)
        index[node] = len(tree.tokens)
        tree.tokens.append(trie.tokens[node])
        tree.parents.append(index[trie.parents[node]])
        tree.scores.append(-neg)
        push(node)
    return tree
