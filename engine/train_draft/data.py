"""Self-distillation data: the target answers each prompt, through this engine.

Each prompt is wrapped in the target's chat template (the shape of the requests it
serves) and answered with up to ``max_tokens`` tokens at a temperature that cycles over
``TEMPERATURES``, each request seeded from ``--seed`` and its index: greedy answers teach
the target's argmax, sampled ones its distribution and more varied contexts. Answers
are written in shards of ``SHARD_SIZE`` prompts (``data/shard-NNNNN.npz``: token ids,
offsets, prompt lengths); a rerun keeps the finished shards and generates the rest.
``data/manifest.json`` records the settings the answers depend on; data made with
other settings is refused, or discarded under ``--restart``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
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


# The flag that sets each manifest entry, for the line that refuses other settings.
MANIFEST_FLAGS = {
    "target": "--model",
    "num_prompts": "--num-prompts",
    "prompts_sha256": "--prompts",
    "max_tokens": "--max-tokens",
    "seed": "--seed",
    "dtype": "--dtype",
    "target_embedding": "--model's embedding",
}


def manifest_for(
    target_name: str,
    prompts: list[str],
    max_tokens: int,
    seed: int,
    dtype: str,
    target_embedding: str | None = None,
) -> dict:
    """Everything the answers depend on, so that data is reused only where generating
    it again would give the same: ``dtype`` is the target's, resolved (bf16 and fp32
    answers differ); ``target_embedding`` (``embedding_fingerprint``) tells the target
    from another one at the same path."""
    digest = hashlib.sha256("\n\x00".join(prompts).encode()).hexdigest()[:16]
    return {
        "target": target_name,
        "target_embedding": target_embedding,
        "num_prompts": len(prompts),
        "prompts_sha256": digest,
        "max_tokens": max_tokens,
        "seed": seed,
        "dtype": dtype,
        "temperatures": list(TEMPERATURES),
    }


def embedding_fingerprint(rows) -> str:
    """A short hash of some rows of a target's embedding (a torch tensor)."""
    rows = rows.detach().float().cpu().numpy()
    return "sha256 " + hashlib.sha256(rows.tobytes()).hexdigest()[:16]


def setting_changes(made: dict, now: dict, flags: dict[str, str] | None = None) -> list[str]:
    """'FLAG OLD, now NEW' for each entry of ``now`` that ``made`` records otherwise;
    ``flags`` names the flag that sets an entry (default: the entry's own name)."""
    flags = flags or {}
    return [
        f"{flags.get(key, key)} {made.get(key, 'unrecorded')}, now {value}"
        for key, value in now.items()
        if made.get(key) != value
    ]


def generate_data(
    engine, prompts: list[str], data_dir: Path, manifest: dict, progress, max_in_flight: int = 64
) -> DataSummary:
    """Answer every prompt not yet in a shard under ``data_dir``; ``progress(n_prompts,
    n_tokens)`` after each finished request. The next shard's prompts go in while a
    shard's last answers finish, so the batch stays full."""
    from engine.io.sampling_params import SamplingParams

    data_dir.mkdir(parents=True, exist_ok=True)
    check_manifest(data_dir, manifest)
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


def data_changes(data_dir: Path, manifest: dict) -> list[str]:
    """How the data in ``data_dir`` was made otherwise than ``manifest`` says (see
    ``setting_changes``); empty when it was made so, or when there is none."""
    path = data_dir / "manifest.json"
    if not path.exists():
        return []
    return setting_changes(json.loads(path.read_text()), manifest, MANIFEST_FLAGS)


def check_manifest(data_dir: Path, manifest: dict) -> None:
    """Refuse data made with other settings, in one line naming each flag and both
    values; record ``manifest`` for new data."""
    changes = data_changes(data_dir, manifest)
    if changes:
        raise ValueError(
            f"{data_dir} holds data made with other settings ({'; '.join(changes)}); "
            "use another --out or --restart"
        )
    path = data_dir / "manifest.json"
    if data_dir.is_dir() and not path.exists():
        path.write_text(json.dumps(manifest, indent=2) + "\n")


def discard_other_data(data_dir: Path, manifest: dict) -> list[str]:
    """Remove ``data_dir`` when its data was made with other settings (``--restart``);
    the changes, empty when the data is kept: it is what generating again would make."""
    changes = data_changes(data_dir, manifest)
    if changes:
        shutil.rmtree(data_dir)
    return changes


def _write_shard(path: Path, sequences: list[list[int]], prompt_lens: list[int]) -> None:
    offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in sequences])
    tokens = np.fromiter((t for s in sequences for t in s), dtype=np.int32, count=int(offsets[-1]))
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, tokens=tokens, offsets=offsets, prompt_lens=np.asarray(prompt_lens, np.int64))
    tmp.replace(path)  # a shard is there whole or not at all


def data_shards(data_dir: Path) -> list[Path]:
    """The finished shards under ``data_dir``, in the order ``load_sequences`` reads them."""
    return [p for p in sorted(data_dir.glob("shard-*.npz")) if not p.name.endswith(".tmp.npz")]


def load_shard(path: Path) -> list[Sequence]:
    with np.load(path) as f:
        tokens, offsets, prompt_lens = f["tokens"], f["offsets"], f["prompt_lens"]
    return [
        Sequence(tokens[offsets[i] : offsets[i + 1]].astype(np.int64), int(prompt_len))
        for i, prompt_len in enumerate(prompt_lens)
    ]


def load_sequences(data_dir: Path) -> list[Sequence]:
    return [seq for path in data_shards(data_dir) for seq in load_shard(path)]
