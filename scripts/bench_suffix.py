"""Token-tree proposers without a model: how long a step's lookup takes, and how many
tokens their trees would let a step keep.

    .venv/bin/python scripts/bench_suffix.py

Text: this repository's Python files, split into words and symbols (a stand-in for a
tokenizer), and a synthetic extraction template filled with other fields.

- timing: per step, the request grows by 1-3 verified tokens and proposes (the
  incremental index update is inside the call), at 500- and 4,000-token contexts, with
  1,000 cached answers of 200 tokens in the caller's scope.
- acceptance: requests one after another (prompt known, output replayed step by
  step), greedy verification by coupling: a step keeps the longest tree path the true
  continuation follows, plus one token. Finished requests join the suffix cache.
  calibration = tokens kept / sum of the kept trees' scores (1 means honest scores).
- memory: tracemalloc's count of a filled cache against its ``cache_bytes``.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import time
import tracemalloc
from pathlib import Path

from engine.spec_decode.draft_tree import DraftTree
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.suffix import SuffixDecoder

ROOT = Path(__file__).resolve().parent.parent
WORD = re.compile(r"\w+|[^\w\s]|\n")


def code_documents() -> list[list[int]]:
    vocab: dict[str, int] = {}
    docs = []
    for path in sorted(ROOT.glob("[a-z]*/**/*.py")):
        if ".venv" in path.parts:
            continue
        words = WORD.findall(path.read_text(errors="replace"))
        docs.append([vocab.setdefault(w, len(vocab)) for w in words])
    return [d for d in docs if len(d) >= 100]


def templated_documents(num: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt + answer, prompt length): one extraction form over many people."""
    rng = random.Random(seed)
    vocab: dict[str, int] = {}
    names = ["Ana", "Bo", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun"]
    towns = ["Lyon", "Pune", "Oslo", "Lima", "Kobe", "Graz", "Turku", "Cork", "Agra"]
    jobs = ["nurse", "chef", "pilot", "baker", "welder", "teacher", "judge", "tailor"]
    doc = []
    for _ in range(num):
        name, town, job = rng.choice(names), rng.choice(towns), rng.choice(jobs)
        age = str(rng.randint(20, 80))
        prompt = (
            f"Read the note and fill in the form, one field per line.\nNote: {name} is "
            f"{age} years old, lives in {town} and works as a {job}."
        )
        answer = (
            f"Name: {name}\nAge: {age}\nCity: {town}\nJob: {job}\nSummary: {name} is a "
            f"{age}-year-old {job} who lives in {town}. {name} works as a {job} and is "
            f"{age} years old."
        )
        p = [vocab.setdefault(w, len(vocab)) for w in WORD.findall(prompt)]
        a = [vocab.setdefault(w, len(vocab)) for w in WORD.findall(answer)]
        doc.append((p + a, len(p)))
    return doc


def accepted_along(tree: DraftTree, future: list[int]) -> int:
    """Greedy coupling: how many nodes the true continuation walks through."""
    children = {
        (parent, token): i for i, (parent, token) in enumerate(zip(tree.parents, tree.tokens))
    }
    node = -1
    for depth, token in enumerate(future):
        node = children.get((node, token))
        if node is None:
            return depth
    return len(future)


def timing(docs: list[list[int]], context_len: int, max_nodes: int, steps: int) -> None:
    rng = random.Random(context_len)
    stream = [t for d in docs for t in d]
    decoder, ngram = SuffixDecoder(), NgramProposer(1, 4)
    for _ in range(1000):
        start = rng.randrange(len(stream) - 264)
        decoder.add_finished(stream[start : start + 264], "k", num_prompt=64)
    start = rng.randrange(len(stream) - context_len - 4 * steps)
    for name, propose in [
        ("suffix", lambda tokens: decoder.propose("r", tokens, "k", max_nodes, max_nodes)),
        ("ngram tree", lambda tokens: ngram.propose_tree_for("r", tokens, max_nodes, max_nodes)),
        ("ngram chain", lambda tokens: ngram.propose_for("r", tokens, max_nodes)),
    ]:
        tokens = stream[start : start + context_len]
        pos = start + context_len
        propose(tokens)  # the first call indexes the prompt: timed apart
        times = []
        for _ in range(steps):
            grow = rng.randint(1, 3)
            tokens.extend(stream[pos : pos + grow])
            pos += grow
            t0 = time.perf_counter()
            propose(tokens)
            times.append(time.perf_counter() - t0)
        times.sort()
        mean, p50, p99 = statistics.fmean(times), times[len(times) // 2], times[-len(times) // 100]
        print(
            f"  context {context_len:5d}  {name:12s} mean {1e6 * mean:6.0f} us"
            f"  p50 {1e6 * p50:6.0f}  p99 {1e6 * p99:6.0f}"
        )


def acceptance(name: str, requests: list[tuple[list[int], int]], max_nodes: int) -> None:
    decoder, ngram = SuffixDecoder(), NgramProposer(1, 4)
    proposers = {
        "suffix": lambda rid, t: decoder.propose(rid, t, "k", max_nodes, max_nodes),
        "ngram tree": lambda rid, t: ngram.propose_tree_for(rid, t, max_nodes, max_nodes),
        "ngram chain": lambda rid, t: DraftTree.chain(ngram.propose_for(rid, t, 8)[0]),
    }
    for label, propose in proposers.items():
        steps = kept = nodes = 0
        predicted = 0.0
        for i, (tokens, num_prompt) in enumerate(requests):
            context = tokens[:num_prompt]
            rid = f"{label}-{i}"
            while len(context) < len(tokens):
                tree = propose(rid, context)
                n = accepted_along(tree, tokens[len(context) :])
                steps, kept, nodes = steps + 1, kept + n, nodes + tree.num_nodes
                predicted += sum(tree.scores)
                context.extend(tokens[len(context) : len(context) + n + 1])
            if label == "suffix":
                decoder.add_finished(tokens, "k", num_prompt)
                decoder.forget(rid)
            ngram.forget(rid)
        print(
            f"  {name:9s} {label:12s} tokens/step {(steps + kept) / steps:5.2f}"
            f"  nodes/step {nodes / steps:5.1f}  calibration {kept / max(predicted, 1e-9):5.2f}"
        )


def memory(docs: list[list[int]], num_answers: int) -> None:
    rng = random.Random(1)
    stream = [t for d in docs for t in d]
    pieces = []
    for _ in range(num_answers):
        start = rng.randrange(len(stream) - 264)
        pieces.append(stream[start : start + 264])
    for cap_mib in (16, 4):
        tracemalloc.start()
        decoder = SuffixDecoder(max_cache_bytes=cap_mib << 20)
        for i, piece in enumerate(pieces):
            decoder.add_finished(piece, f"scope{i % 4}", num_prompt=64)
        used = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        print(
            f"  cap {cap_mib:3d} MiB: {decoder.cache_tokens} tokens held, estimated"
            f" {decoder.cache_bytes / 2**20:6.2f} MiB, measured {used / 2**20:6.2f} MiB"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-nodes", type=int, default=24)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    docs = code_documents()
    print(f"timing ({len(docs)} files, {sum(map(len, docs))} tokens of text)")
    for context_len in (500, 4000):
        timing(docs, context_len, args.max_nodes, args.steps)
    print(f"acceptance (tokens a step keeps, max_nodes {args.max_nodes})")
    rng = random.Random(0)
    code = rng.sample(docs, 120)
    acceptance("code", [(d[:800], len(d[:800]) // 4) for d in code], args.max_nodes)
    acceptance("templated", templated_documents(120), args.max_nodes)
    print("memory (answers of 200 tokens + 64 of prompt, 4 scopes)")
    memory(docs, 4_000)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
