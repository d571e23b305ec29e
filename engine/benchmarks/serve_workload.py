"""Request streams for `specserve bench serve`: synthetic lengths, JSONL prompts, ShareGPT.

A workload is built once (it may tokenize through the server's Tokenize RPC) and then
yields an endless, seeded sequence of `BenchRequest`s: the same seed and the same
server give the same prompts and output lengths in the same order.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.benchmarks.workloads import BUILTIN, CHAT_PROMPTS, GROUNDED_PROMPTS, JSON_REQUESTS

DATASETS = (
    "synthetic",
    "chat",
    "grounded",
    "json",
    "repeated",
    "jsonl",
    "sharegpt",
    "shared-prefix",
)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request to send. Exactly one of `text` / `token_ids` is set."""

    index: int
    max_tokens: int
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    num_prompt_tokens: int | None = None
    # A system prompt sent before `text` (shared-prefix workloads).
    system: str | None = None
    # The JSON schema (text) the answer must follow: the request's structured output.
    json_schema: str | None = None

    def messages(self) -> list[dict[str, str]]:
        """The prompt as chat turns: the system prompt, if any, then `text` as the user."""
        turns = [{"role": "system", "content": self.system}] if self.system else []
        return [*turns, {"role": "user", "content": self.text or ""}]

    @property
    def plain_text(self) -> str:
        """The prompt as one text, for servers called without a chat template."""
        return f"{self.system}\n\n{self.text}" if self.system else self.text or ""


@dataclass(frozen=True)
class LengthDist:
    """Integer lengths uniform in [mean * (1 - range_ratio), mean * (1 + range_ratio)]."""

    mean: int
    range_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.mean < 1:
            raise ValueError(f"length must be >= 1, got {self.mean}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")

    @property
    def bounds(self) -> tuple[int, int]:
        lo = max(1, round(self.mean * (1 - self.range_ratio)))
        return lo, max(lo, round(self.mean * (1 + self.range_ratio)))

    def sample(self, rng: random.Random) -> int:
        return rng.randint(*self.bounds)


@dataclass(frozen=True)
class TextItem:
    """A prompt from a file; `output_len` None means: use the --output-len distribution."""

    text: str
    output_len: int | None = None
    json_schema: str | None = None


def synthetic_requests(
    corpus_ids: list[int], input_len: LengthDist, output_len: LengthDist, seed: int
) -> Iterator[BenchRequest]:
    """Token-id prompts of sampled length: windows of a tokenized text corpus at random
    offsets (wrapping), so the prompts are natural text that prompt lookup can match."""
    if not corpus_ids:
        raise ValueError("synthetic workload: empty corpus")
    rng = random.Random(seed)
    index = 0
    while True:
        n = input_len.sample(rng)
        start = rng.randrange(len(corpus_ids))
        ids = tuple(corpus_ids[(start + i) % len(corpus_ids)] for i in range(n))
        yield BenchRequest(index, output_len.sample(rng), token_ids=ids, num_prompt_tokens=n)
        index += 1


def text_requests(
    items: list[TextItem], output_len: LengthDist, seed: int
) -> Iterator[BenchRequest]:
    """Items drawn uniformly with replacement; lengths from the item or the distribution."""
    if not items:
        raise ValueError("workload has no prompts")
    rng = random.Random(seed)
    index = 0
    while True:
        item = items[rng.randrange(len(items))]
        sampled = output_len.sample(rng)  # drawn always, so the stream does not shift
        yield BenchRequest(
            index, item.output_len or sampled, text=item.text, json_schema=item.json_schema
        )
        index += 1


def shared_prefix_requests(
    num_prefixes: int, prefix_chars: int, output_len: LengthDist, seed: int
) -> Iterator[BenchRequest]:
    """Many requests on a few long system prompts: each request takes one of
    `num_prefixes` system prompts (windows of `prefix_chars` characters of the corpus,
    the same for every seed) and a short question, both uniformly at random. The
    workload of prefix caching and cache-aware routing."""
    if num_prefixes < 1 or prefix_chars < 1:
        raise ValueError("--num-prefixes and --prefix-chars must be >= 1")
    corpus = corpus_text()
    layout = random.Random(0)
    prefixes = []
    for _ in range(num_prefixes):
        start = layout.randrange(len(corpus))
        prefixes.append("".join(corpus[(start + i) % len(corpus)] for i in range(prefix_chars)))
    rng = random.Random(seed)
    index = 0
    while True:
        system = prefixes[rng.randrange(num_prefixes)]
        question = CHAT_PROMPTS[rng.randrange(len(CHAT_PROMPTS))]
        yield BenchRequest(index, output_len.sample(rng), text=question, system=system)
        index += 1


def corpus_text() -> str:
    """The text synthetic prompts are cut from: the built-in prompt sets."""
    return "\n\n".join(GROUNDED_PROMPTS + CHAT_PROMPTS)


def builtin_items(name: str) -> list[TextItem]:
    """A built-in prompt set; json: each extraction prompt with its schema."""
    if name == "json":
        return [TextItem(p, json_schema=json.dumps(s)) for p, s in JSON_REQUESTS]
    return [TextItem(p) for p in BUILTIN[name]]


def load_jsonl(path: str | Path) -> list[TextItem]:
    """One JSON object per line with "prompt" and optionally "output_len" / "max_tokens"."""
    items = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "prompt" not in row:
            raise ValueError(f"{path}:{n}: no 'prompt' field")
        output_len = row.get("output_len", row.get("max_tokens"))
        items.append(TextItem(row["prompt"], int(output_len) if output_len else None))
    if not items:
        raise ValueError(f"{path}: no prompts found")
    return items


def load_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(first human turn, the reply to it) per conversation, from a ShareGPT JSON array
    (or JSONL) of {"conversations": [{"from": "human"|"gpt", "value": ...}, ...]}."""
    text = Path(path).read_text()
    rows = (
        json.loads(text)
        if text.lstrip().startswith("[")
        else [json.loads(line) for line in text.splitlines() if line.strip()]
    )
    pairs = []
    for row in rows:
        turns = row.get("conversations") or row.get("conversation") or []
        if len(turns) >= 2 and _role(turns[0]) == "human" and _role(turns[1]) == "gpt":
            pairs.append((turns[0]["value"], turns[1]["value"]))
    if not pairs:
        raise ValueError(f"{path}: no human/gpt conversation pairs found")
    return pairs


def sharegpt_items(
    pairs: list[tuple[str, str]], reply_lens: list[int], prompt_lens: list[int], max_len: int
) -> list[TextItem]:
    """Keep pairs whose prompt and reply have >= 4 tokens and fit the context; the
    reply's token count becomes the request's output length (as in vLLM's benchmark)."""
    return [
        TextItem(prompt, n_out)
        for (prompt, _), n_in, n_out in zip(pairs, prompt_lens, reply_lens, strict=True)
        if n_in >= 4 and n_out >= 4 and n_in + n_out <= max_len
    ]


def _role(turn: dict) -> str:
    role = turn.get("from", turn.get("role", ""))
    return {"user": "human", "assistant": "gpt", "chatgpt": "gpt"}.get(role, role)
