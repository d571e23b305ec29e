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
with two indexes, for 1-grams and 4-grams: key -> the latest position where it ends,
and per position the one where the same key ended before (a linked list through the
text, newest first: one array entry per token and key length, one dict entry per
distinct key). The lookup walks the occurrences of the context's last 4 tokens (else of
its last token), most recent first, measures each match backwards up to ``max_match``
(slices compared a chunk at a time), and keeps the occurrences of the longest match in
either source, the request's own text or its caller's cache (SuffixDecoding's suffix
tree node: the occurrences sharing the longest suffix). Their continuations make a
trie with a count per node (``DraftTree.from_continuations``); a node's score is the
product down its path of ``count(child) / (count(parent) + c)``, ``c`` a pseudo-count
that shrinks as the match grows (a 16-token match is more telling than a 4-token one),
so a single earlier occurrence still scores below 1 and deeper nodes score less. The
tree is the best ``max_nodes`` nodes by score, taken best first, its size capped at
``alpha`` times the match length (SuffixDecoding's adaptive speculation length).

The per-request text is the request's prompt and output, extended as tokens are
verified. The cache of recent answers holds finished requests' text (the end of the
prompt, where the answer's first tokens are matched, and the output) per scope (the
caller's API key id: how fast a guess is accepted could otherwise reveal another
caller's text), the oldest evicted first once the estimated memory of all scopes passes
``max_cache_bytes``. The end of the prompt pays because the first tokens of an answer
are predicted by what the prompt ended with (a template's instruction); a whole prompt
would mostly hold the fields that differ. Evicting an answer drops its index entries at
once (it is its scope's oldest text, so a key whose latest occurrence is in it has no
other) and its tokens when the dead prefix outgrows the rest (one memmove): memory is
counted, not guessed (``cache_bytes``), and no eviction rebuilds anything.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from typing import NamedTuple

from engine.spec_decode.draft_tree import DraftTree

# Index key lengths: a 4-gram match, else a 1-token one.
LONG_KEY = 4
# Occurrences of a key considered per lookup, most recent first.
MAX_CANDIDATES = 48
# The most tokens of a finished request's prompt kept with its answer.
PROMPT_TAIL = 64
# Requests whose own index is kept; the least recently used beyond this is rebuilt.
MAX_INDEXED_REQUESTS = 256
# What the cache holds, per unit, measured with tracemalloc on CPython 3.11 (scripts/
# bench_suffix.py reports the estimate against the measurement): a token and its two
# links (8-byte array entries, with the arrays' spare room); a distinct key (its dict
# slot, its int key and its int position: ~100 bytes in a dict that only grew, ~150 in
# one that evicts, as deleted slots wait for the next resize); a cached answer's
# bookkeeping. A cache that only grew is overestimated by ~25%; one that evicts, the
# steady state, measures 85-95% of the estimate.
BYTES_PER_TOKEN = 28
BYTES_PER_KEY = 160
BYTES_PER_ANSWER = 100
# Match lengths are measured this many tokens at a time (slices compared in C).
_CHUNK = 8


class SuffixText:
    """A growing token sequence with its 1-gram and 4-gram indexes. Position ``e`` is
    where a key ends (the index of the token after it); ``last[j]`` maps a key to its
    latest end and ``links[j][e - 1 - base]`` holds the end before that one (-1: none),
    ``j`` 0 for 1-grams and 1 for 4-grams. 4-gram keys are the hash of the 4 tokens: a
    collision only offers a candidate whose measured match is short.

    Positions below ``floor`` are evicted; the arrays start at position ``base``."""

    __slots__ = ("tokens", "base", "floor", "length", "last", "links")

    def __init__(self, tokens: list[int] | None = None) -> None:
        # a request's own list (indexed as it grows), else a cache's array
        self.tokens: list[int] | array = tokens if tokens is not None else array("q")
        self.base = 0
        self.floor = 0
        self.length = 0  # positions indexed
        self.last: tuple[dict[int, int], dict[int, int]] = ({}, {})
        self.links = (array("q"), array("q"))

    def extend(self, tokens: Sequence[int]) -> None:
        """Index ``tokens`` appended after what is there."""
        self.tokens.extend(tokens)
        self.index_to(self.base + len(self.tokens))

    def index_to(self, end: int) -> None:
        """Index the positions up to ``end``."""
        first, base, tokens = self.length, self.base, self.tokens
        if end <= first:
            return
        lo = max(first, min(end, base + LONG_KEY - 1))  # a 4-gram needs 3 tokens before it
        self.links[1].extend([-1] * (lo - first))  # no 4-gram ends there: never matched
        keys = (
            tokens[first - base : end - base],
            map(hash, zip(*(tokens[lo - base - k : end - base - k] for k in (3, 2, 1, 0)))),
        )
        for j, start in enumerate((first, lo)):
            last, links = self.last[j], self.links[j]
            get, append = last.get, links.append
            for pos, key in enumerate(keys[j], start + 1):
                append(get(key, -1))
                last[key] = pos
        self.length = end

    def occurrences(self, context: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` ends of earlier occurrences of the context's last 4 tokens
        (else of its last token), most recent first."""
        for j, key in ((1, hash(tuple(context[-LONG_KEY:]))), (0, context[-1])):
            if j == 1 and len(context) < LONG_KEY:
                continue
            end, links, out = self.last[j].get(key, -1), self.links[j], []
            while end > self.floor and len(out) < limit:
                out.append(end)
                end = links[end - 1 - self.base]
            if out:
                return out
        return []

    def match_length(self, end: int, lo: int, tail: Sequence[int], limit: int) -> int:
        """How many tokens before ``end`` (down to ``lo``) equal the end of ``tail``
        (a list for a list's text, an array for an array's), at most ``limit``."""
        tokens, base, size = self.tokens, self.base, len(tail)
        limit = min(limit, end - lo)
        if tokens[end - limit - base : end - base] == tail[size - limit :]:
            return limit
        length = 0
        while True:  # the whole did not match: some chunk fails
            step = min(_CHUNK, limit - length)
            at = end - length - base
            if tokens[at - step : at] != tail[size - length - step : size - length]:
                while tokens[at - 1] == tail[size - length - 1]:
                    at, length = at - 1, length + 1
                return length
            length += step

    def drop(self, start: int, end: int) -> None:
        """Evict positions [start, end), the oldest live ones: keys whose latest end is
        in there have no other occurrence left; the dead prefix's tokens go once it
        outgrows the live part (3 kept: the keys that end after them)."""
        tokens, base = self.tokens, self.base
        for j, last in enumerate(self.last):
            for pos in range(max(start, base + (LONG_KEY - 1) * j), end):
                if j == 0:
                    key = tokens[pos - base]
                else:
                    key = hash(tuple(tokens[pos - base - 3 : pos - base + 1]))
                if last.get(key, end + 1) <= end:
                    del last[key]
        self.floor = end
        dead = end - (LONG_KEY - 1) - base
        if dead > len(tokens) - dead:
            del tokens[:dead], self.links[0][:dead], self.links[1][:dead]
            self.base += dead

    def footprint(self) -> int:
        """Estimated bytes of this text (the cache's texts only: a request's list is
        the request's)."""
        keys = len(self.last[0]) + len(self.last[1])
        return len(self.tokens) * BYTES_PER_TOKEN + keys * BYTES_PER_KEY


class _Scope:
    """One caller's cached answers: a text and its live answers' bounds, oldest first."""

    __slots__ = ("text", "starts", "ends")

    def __init__(self) -> None:
        self.text = SuffixText()
        self.starts: list[int] = []
        self.ends: list[int] = []

    def bounds(self, end: int) -> tuple[int, int]:
        """(start, end) of the answer holding the token before position ``end``."""
        i = bisect_right(self.starts, end - 1) - 1
        return self.starts[i], self.ends[i]

    def footprint(self) -> int:
        return self.text.footprint() + len(self.ends) * BYTES_PER_ANSWER


class _Candidate(NamedTuple):
    length: int  # tokens matched
    text: SuffixText
    end: int  # where the continuation starts
    stop: int  # where it must stop (its text's or its answer's end)


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
        if not 1 <= max_match <= 1024:
            raise ValueError(f"max_match must be in [1, 1024], got {max_match}")
        if alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {alpha}")
        self.max_cache_bytes = max_cache_bytes
        self.max_match = max_match
        self.alpha = alpha
        self.min_match = min_match
        self._requests: OrderedDict[str, SuffixText] = OrderedDict()
        self._scopes: dict[str | None, _Scope] = {}
        self._order: deque[str | None] = deque()  # a scope per cached answer, oldest first
        self.cache_bytes = 0  # estimated memory of every scope's cache (see footprint)
        self.cache_tokens = 0  # tokens of the live cached answers, all scopes
        self.last_match_length = 0  # of the latest propose (0: nothing matched)

    # ---- the cache of recent answers -------------------------------------------------
    def add_finished(
        self, token_ids: Sequence[int], scope: str | None, num_prompt: int = 0
    ) -> None:
        """Cache a finished request's text (the last PROMPT_TAIL tokens of its prompt,
        the first ``num_prompt`` of ``token_ids``, and its output) for ``scope``; the
        oldest answers of any scope go until the cache fits ``max_cache_bytes``."""
        tokens = token_ids[max(0, num_prompt - PROMPT_TAIL) :]
        cost = len(tokens) * (BYTES_PER_TOKEN + 2 * BYTES_PER_KEY) + BYTES_PER_ANSWER
        if len(tokens) < 2 or cost > self.max_cache_bytes:
            return  # it could never fit
        cached = self._scopes.get(scope)
        if cached is None:
            cached = self._scopes[scope] = _Scope()
        before = cached.footprint()
        cached.starts.append(cached.text.base + len(cached.text.tokens))
        cached.text.extend(tokens)
        cached.ends.append(cached.text.length)
        self._order.append(scope)
        self.cache_tokens += len(tokens)
        self.cache_bytes += cached.footprint() - before
        while self.cache_bytes > self.max_cache_bytes:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        scope = self._order.popleft()
        cached = self._scopes[scope]
        before = cached.footprint()
        start, end = cached.starts.pop(0), cached.ends.pop(0)
        cached.text.drop(start, end)
        self.cache_tokens -= end - start
        if cached.ends:
            self.cache_bytes += cached.footprint() - before
        else:
            del self._scopes[scope]
            self.cache_bytes -= before

    # ---- per request -----------------------------------------------------------------
    def _own(self, request_id: str, token_ids: list[int]) -> SuffixText:
        text = self._requests.get(request_id)
        if text is None or text.tokens is not token_ids or len(token_ids) < text.length:
            text = self._requests[request_id] = SuffixText(token_ids)
            if len(self._requests) > MAX_INDEXED_REQUESTS:
                self._requests.popitem(last=False)
        self._requests.move_to_end(request_id)
        # the last token has no continuation yet: its keys would end past the text
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
        ``token_ids`` (the request's prompt and output, the same list from call to call,
        growing): the longest match's continuations in the request's own text and in
        ``scope``'s cache (both, when they match equally long), at most ``alpha`` times
        the match length nodes. Empty when nothing matches."""
        self.last_match_length = 0
        if max_nodes <= 0 or max_depth <= 0 or len(token_ids) < 2:
            return DraftTree()
        tail = token_ids[-self.max_match :]
        found = self._candidates(self._own(request_id, token_ids), tail, None)
        cached = self._scopes.get(scope)
        if cached is not None:
            found += self._candidates(cached.text, array("q", tail), cached)
        length = max((c.length for c in found), default=0)
        if length < max(1, self.min_match):
            return DraftTree()
        self.last_match_length = length
        budget = min(max_nodes, max(1, math.ceil(self.alpha * length)))
        depth = min(max_depth, budget)  # no deeper than the tree can reach
        continuations = Counter(
            tuple(c.text.tokens[c.end - c.text.base : min(c.stop, c.end + depth) - c.text.base])
            for c in found
            if c.length == length
        )
        return DraftTree.from_continuations(continuations.items(), budget, 4.0 / length)

    def _candidates(
        self, text: SuffixText, tail: Sequence[int], cached: _Scope | None
    ) -> list[_Candidate]:
        """The text's recent occurrences of the context's tail that have a
        continuation, with their match lengths (inside their own answer, for a cache)."""
        out = []
        for end in text.occurrences(tail, MAX_CANDIDATES):
            start, stop = (0, text.length + 1) if cached is None else cached.bounds(end)
            if end < stop:
                length = text.match_length(end, start, tail, self.max_match)
                out.append(_Candidate(length, text, end, stop))
        return out
