"""Self-distillation data: the target answers each prompt, through this engine.

Each prompt is wrapped in the target's chat template (the shape of the requests it
serves) and answered with up to ``max_tokens`` tokens at a temperature that cycles over
``TEMPERATURES``, each request seeded from ``--seed`` and its index: greedy answers teach
the target's argmax, sampled ones its distribution and more varied contexts. Answers
are written in shards of ``SHARD_SIZE`` prompts (``data/shard-NNNNN.npz``: token ids,
offsets, prompt lengths); a rerun keeps the finished shards and generates the rest.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TEMPERATURES = (0.0, 0.7, 1.0)
SHARD_SIZE = 128


@dataclass
class Sequence:
    token_ids: np.ndarray  # int64 [prompt + response]
    prompt_len: int


@dataclass
class DataSummary:
    num_sequences: int
    num_response_tokens: int
    seconds: float  # spent generating in this run (0 when every shard was there)


def manifest_for(target_name: str, prompts: list[str], max_tokens: int, seed: int) -> dict:
    digest = hashlib.sha256("\n\x00".join(prompts).encode()).hexdigest()[:16]
    return {
        "target": target_name,
        "num_prompts": len(prompts),
        "prompts_sha256": digest,
        "max_tokens": max_tokens,
        "seed": seed,
        "temperatures": list(TEMPERATURES),
    }


def generate_data(
    engine, prompts: list[str], data_dir: Path, manifest: dict, progress, max_in_flight: int = 64
) -> DataSummary:
    """Answer every prompt not yet in a shard under ``data_dir``; ``progress(n_prompts,
    n_tokens)`` after each finished request. The next shard's prompts go in while a
    shard's last answers finish, so the batch stays full."""
    from engine.io.sampling_params import SamplingParams

    data_dir.mkdir(parents=True, exist_ok=True)
    _check_manifest(data_dir, manifest)
    prompt_ids = _chat_token_ids(engine.tokenizer, prompts)
    num_shards = -(-len(prompts) // SHARD_SIZE)
    todo: list[int] = []
    for shard in range(num_shards):
        path = _shard_path(data_dir, shard)
        indices = range(shard * SHARD_SIZE, min(len(prompts), (shard + 1) * SHARD_SIZE))
        if path.exists():
            with np.load(path) as f:
                progress(len(indices), int(f["offsets"][-1] - f["prompt_lens"].sum()))
        else:
            todo += indices
    start = time.perf_counter()
    answers: dict[int, list[int]] = {}
    left_in_shard = {s: 0 for s in range(num_shards)}
    for index in todo:
        left_in_shard[index // SHARD_SIZE] += 1
    queue = iter(todo)
    in_flight = 0
    while True:
        while in_flight < max_in_flight and (index := next(queue, None)) is not None:
            params = SamplingParams(
                max_tokens=manifest["max_tokens"],
                temperature=TEMPERATURES[index % len(TEMPERATURES)],
                seed=manifest["seed"] * 1_000_003 + index,
            )
            answers[index] = []
            engine.add_request(f"distill-{index}", prompt_ids[index], params)
            in_flight += 1
        if not engine.has_unfinished_requests():
            break
        for delta in engine.step():
            index = int(delta.request_id.removeprefix("distill-"))
            answers[index].extend(delta.token_ids)
            if not delta.finished:
                continue
            in_flight -= 1
            progress(1, len(answers[index]))
            shard = index // SHARD_SIZE
            left_in_shard[shard] -= 1
            if left_in_shard[shard] == 0:
                indices = range(shard * SHARD_SIZE, min(len(prompts), (shard + 1) * SHARD_SIZE))
                _write_shard(
                    _shard_path(data_dir, shard),
                    [prompt_ids[i] + answers.pop(i) for i in indices],
                    [len(prompt_ids[i]) for i in indices],
                )
    sequences = load_sequences(data_dir)
    return DataSummary(
        num_sequences=len(sequences),
        num_response_tokens=sum(len(s.token_ids) - s.prompt_len for s in sequences),
        seconds=time.perf_counter() - start if todo else 0.0,
    )


def _shard_path(data_dir: Path, shard: int) -> Path:
    return data_dir / f"shard-{shard:05d}.npz"


def _chat_token_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    from engine.benchmarks.offline import tokenize_prompts

    return tokenize_prompts(tokenizer, prompts, chat=True)


def _check_manifest(data_dir: Path, manifest: dict) -> None:
    path = data_dir / "manifest.json"
    if path.exists():
        existing = json.loads(path.read_text())
        if existing != manifest:
            changed = sorted(k for k in manifest if existing.get(k) != manifest[k])
            raise ValueError(
                f"{data_dir} holds data made with other settings ({', '.join(changed)}); "
                "use another --out or --restart"
            )
        return
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def _write_shard(path: Path, sequences: list[list[int]], prompt_lens: list[int]) -> None:
    offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in sequences])
    tokens = np.fromiter((t for s in sequences for t in s), dtype=np.int32, count=int(offsets[-1]))
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, tokens=tokens, offsets=offsets, prompt_lens=np.asarray(prompt_lens, np.int64))
    tmp.replace(path)  # a shard is there whole or not at all


def load_sequences(data_dir: Path) -> list[Sequence]:
    sequences = []
    for path in sorted(data_dir.glob("shard-*.npz")):
        if path.name.endswith(".tmp.npz"):
            continue
        with np.load(path) as f:
            tokens, offsets, prompt_lens = f["tokens"], f["offsets"], f["prompt_lens"]
        for i, prompt_len in enumerate(prompt_lens):
            seq = tokens[offsets[i] : offsets[i + 1]].astype(np.int64)
            sequences.append(Sequence(seq, int(prompt_len)))
    return sequences
