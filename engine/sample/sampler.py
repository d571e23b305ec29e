"""Batched sampling on the model's device.

Temperature, top-k, top-p and min-p turn a row of logits into the *processed*
distribution that is actually sampled. Greedy rows (temperature 0) become a one-hot
at the argmax, so the same code path serves greedy and random rows, and so the
rejection sampler sees greedy as the exact-match special case.

Random draws use the exponential race: ``argmax(probs / E)`` with ``E ~ Exp(1)`` i.i.d.
is an exact sample from ``probs`` and needs no cumulative sums or host syncs.

Where the noise comes from is what makes a request reproducible. A seeded request's
noise for the token at sequence position ``t`` is drawn from a generator seeded with
``position_seed(seed, t)`` and nothing else, so its output is a function of model,
prompt, parameters and seed: the same alone or in any batch, with any speculation
length, with or without speculation (the verifier couples drafts to exactly this
noise). Unseeded rows draw from the engine's generator, which the batch advances.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.io.sampling_params import SamplingParams
from engine.kernels.cpu import cpu_kernels


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters as tensors. One row per distribution to sample."""

    temperature: torch.Tensor  # [n] float32; 0 = greedy
    top_k: torch.Tensor | None  # [n] int64; 0 = off. None when no row uses it
    top_p: torch.Tensor | None  # [n] float32; 1 = off
    min_p: torch.Tensor | None  # [n] float32; 0 = off
    is_greedy: list[bool]
    seeds: list[int | None]  # per row; None = the engine's generator
    positions: list[int]  # per row: the sequence position of the token it samples

    @property
    def all_greedy(self) -> bool:
        return all(self.is_greedy)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        positions: list[int],
        device: torch.device,
    ) -> SamplingBatch:
        def column(values: list, dtype: torch.dtype, off: float) -> torch.Tensor | None:
            if all(v == off for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=torch.tensor([p.temperature for p in params], device=device),
            top_k=column([p.top_k for p in params], torch.int64, 0),
            top_p=column([p.top_p for p in params], torch.float32, 1.0),
            min_p=column([p.min_p for p in params], torch.float32, 0.0),
            is_greedy=[p.is_greedy for p in params],
            seeds=[p.seed for p in params],
            positions=list(positions),
        )

    def repeat_rows(self, counts: list[int], offsets: list[list[int]] | None = None):
        """Row i repeated counts[i] times, one row per verified position: the j-th copy
        samples position ``positions[i] + j`` (``+ offsets[i][j]``: a token tree's rows
        sample the position of their depth)."""
        index = torch.repeat_interleave(
            torch.arange(len(counts), device=self.temperature.device),
            torch.tensor(counts, device=self.temperature.device),
        )

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        rows = [(i, j) for i, c in enumerate(counts) for j in range(c)]
        return SamplingBatch(
            temperature=self.temperature[index],
            top_k=pick(self.top_k),
            top_p=pick(self.top_p),
            min_p=pick(self.min_p),
            is_greedy=[self.is_greedy[i] for i, _ in rows],
            seeds=[self.seeds[i] for i, _ in rows],
            positions=[
                self.positions[i] + (j if offsets is None else offsets[i][j]) for i, j in rows
            ],
        )

    def select(self, rows: list[int]) -> SamplingBatch:
        """The given rows, in order."""
        index = torch.tensor(rows, dtype=torch.long, device=self.temperature.device)

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        return SamplingBatch(
            temperature=self.temperature[index],
            top_k=pick(self.top_k),
            top_p=pick(self.top_p),
            min_p=pick(self.min_p),
            is_greedy=[self.is_greedy[i] for i in rows],
            seeds=[self.seeds[i] for i in rows],
            positions=[self.positions[i] for i in rows],
        )


def processed_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution each row is sampled from.

    logits: [n, vocab_size] float32. Returns [n, vocab_size] float32 rows summing to 1.
    """
    greedy = torch.tensor(batch.is_greedy, device=logits.device)
    if batch.all_greedy:
        return _one_hot_argmax(logits)
    temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
    logits = logits / temperature.unsqueeze(1)
    if batch.top_k is not None or batch.top_p is not None:
        logits = _apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    probs = torch.softmax(logits, dim=-1)
    if batch.min_p is not None:
        threshold = batch.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if any(batch.is_greedy):
        probs = torch.where(greedy.unsqueeze(1), _one_hot_argmax(logits), probs)
    return probs


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """The first maximal index of each row of a 2-D tensor (NaN counts as maximal), as
    ``x.argmax(dim=-1)``. On the CPU, fp32 rows with a dense last dimension go to the
    compiled kernel: [32, 49,152] in 0.19 against 0.93-1.55 ms for torch's ``max(dim)``
    on the Xeon with AMX, 2 threads (docs/benchmarks.md, "Sampling's noise and argmax"),
    and 5x less for the rows of a verification of many drafts. Elsewhere ``max(dim)``,
    which documents the same first-index rule and runs 2.4x faster than ``argmax``."""
    kernels = _row_kernels(x)
    return kernels.row_argmax(x) if kernels is not None else x.max(dim=-1).indices


def nonfinite_rows(x: torch.Tensor) -> list[int]:
    """The rows of 2-D logits ``x`` that hold a NaN or +Inf, in order ([] while every
    value is finite or -Inf). On the CPU, fp32 rows go to the compiled kernel (one pass);
    elsewhere one sum over ``x`` (finite or -Inf only where no value is NaN or +Inf) and
    one number read back, and the rows only when it is not."""
    kernels = _row_kernels(x)
    if kernels is not None:
        return kernels.nonfinite_rows(x)
    total = float(x.sum(dtype=torch.float32))
    if total == total and total != float("inf"):
        return []
    bad = (torch.isnan(x) | torch.isposinf(x)).any(dim=-1)
    return torch.nonzero(bad).flatten().tolist()


def _row_kernels(x: torch.Tensor):
    """The compiled kernels where they read ``x``'s rows in place (fp32 [n, V >= 1] on
    the CPU, each row dense, rows not overlapping), or None."""
    if (
        x.is_cpu
        and x.dtype is torch.float32
        and x.dim() == 2
        and x.shape[1] > 0
        and x.stride(1) == 1
        and x.stride(0) >= x.shape[1]
    ):
        return cpu_kernels()
    return None


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    probs = torch.zeros_like(logits)
    probs.scatter_(1, row_argmax(logits).unsqueeze(1), 1.0)
    return probs


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [n, vocab_size]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, logits.shape[-1]))
        ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
        remove |= ranks >= k.unsqueeze(1)
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        # Drop a token when the tokens strictly more likely already cover top_p.
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= mass_before >= top_p.unsqueeze(1)
    remove[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def position_seed(seed: int, position: int) -> int:
    """The generator seed for a seeded request's token at ``position``: a 64-bit mix
    of both, so neighbouring positions and neighbouring seeds draw unrelated noise."""
    return _splitmix64((_splitmix64(seed) + position) & _MASK64)


def random_keys(count: int, default: torch.Generator | None) -> list[int]:
    """``count`` 64-bit noise keys from ``default`` (torch's own generator when None)."""
    if not count:
        return []
    drawn = torch.randint(-(2**63), 2**63 - 1, (count,), dtype=torch.int64, generator=default)
    return drawn.tolist()


def exponential_noise(
    batch: SamplingBatch,
    vocab_size: int,
    device: torch.device,
    default: torch.Generator | None,
) -> torch.Tensor:
    """Exp(1) noise [n, vocab_size], one row per batch row: seeded rows from
    ``position_seed(seed, position)``, unseeded random rows from ``default``, greedy
    rows all ones (they take the argmax). On the CPU the compiled kernels draw it
    (``exponential_rows``: a row is a function of its 64-bit key, the seeded row's
    ``position_seed``, an unseeded row's drawn from ``default``), 18x torch's
    ``exponential_`` ([32, 49,152]: 2.0 against 37.3 ms, docs/benchmarks.md, "Sampling's
    noise and argmax"); elsewhere torch's generators, one seeded per seeded row."""
    kernels = cpu_kernels() if device.type == "cpu" else None
    if kernels is not None:
        return _kernel_noise(kernels, batch, vocab_size, default)
    noise = torch.ones((len(batch.seeds), vocab_size), device=device)
    unseeded = [
        i for i, (s, g) in enumerate(zip(batch.seeds, batch.is_greedy)) if s is None and not g
    ]
    if len(unseeded) == len(batch.seeds):
        noise.exponential_(generator=default)
    elif unseeded:
        drawn = torch.empty((len(unseeded), vocab_size), device=device)
        noise[unseeded] = drawn.exponential_(generator=default)
    for i, (seed, position) in enumerate(zip(batch.seeds, batch.positions)):
        if seed is not None and not batch.is_greedy[i]:
            generator = torch.Generator(device).manual_seed(position_seed(seed, position))
            noise[i].exponential_(generator=generator)
    return noise


def _kernel_noise(kernels, batch: SamplingBatch, vocab_size: int, default) -> torch.Tensor:
    drawn = [i for i, greedy in enumerate(batch.is_greedy) if not greedy]
    unseeded = iter(random_keys(sum(batch.seeds[i] is None for i in drawn), default))
    keys = []
    for i in drawn:
        seed = batch.seeds[i]
        keys.append(next(unseeded) if seed is None else position_seed(seed, batch.positions[i]))
    if len(drawn) == len(batch.seeds):
        return kernels.exponential_rows(torch.empty((len(drawn), vocab_size)), keys)
    noise = torch.ones((len(batch.seeds), vocab_size))
    if drawn:
        noise[drawn] = kernels.exponential_rows(torch.empty((len(drawn), vocab_size)), keys)
    return noise


def sample_rows(dist: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``dist`` [n, V] (non-negative weights, any scale) by inverse
    CDF at ``u`` [n] float64 in [0, 1): the first index whose running sum exceeds u
    times the row's sum, in double precision; a token of weight 0 is never taken. For
    rows no draft is coupled to (rejection sampling's recovered and bonus tokens): one
    uniform a row where the race needs a draw a token. The compiled kernel on the CPU
    ([32, 49,152]: docs/benchmarks.md, "Sampling's noise and argmax"), torch's cumsum
    and searchsorted elsewhere (the same rule)."""
    kernels = _row_kernels(dist)
    if kernels is not None:
        return kernels.sample_rows(dist, u.to(device="cpu", dtype=torch.float64))
    running = dist.double().cumsum(dim=-1)  # [n, V]
    target = (u.to(running.device, torch.float64) * running[:, -1]).unsqueeze(1)
    index = torch.searchsorted(running, target, right=True).squeeze(1)  # first > target
    last = dist.shape[1] - 1 - (dist.flip(-1) > 0).to(torch.int64).argmax(dim=-1)
    return torch.minimum(index, last)


def final_uniforms(num_rows: int, device: torch.device, default) -> torch.Tensor:
    """U[0, 1) [num_rows] float64 from ``default``: sample_rows' draws."""
    return torch.rand(num_rows, dtype=torch.float64, device=device, generator=default)


def uniform_noise(
    num_rows: int, num_cols: int, device: torch.device, default: torch.Generator | None
) -> torch.Tensor:
    """U[0, 1) noise [num_rows, num_cols] from ``default`` (rejection sampling of
    unseeded rows; seeded rows are verified by coupling and need none)."""
    return torch.rand((num_rows, num_cols), device=device, generator=default)


def sample_from_probs(
    probs: torch.Tensor, batch: SamplingBatch, default: torch.Generator | None
) -> torch.Tensor:
    """One token per row. probs: [n, vocab_size]. Returns [n] int64."""
    if batch.all_greedy:
        return row_argmax(probs)
    noise = exponential_noise(batch, probs.shape[-1], probs.device, default)
    return row_argmax(probs / noise)


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw model log-probabilities (before sampling filters) of the chosen tokens and the
    top ``num_top`` alternatives. logits: [n, V]; token_ids: [n].
    Returns (chosen [n], top_values [n, num_top], top_ids [n, num_top])."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top_values, top_ids = (
        logprobs.topk(num_top, dim=-1)
        if num_top
        else (
            logprobs[:, :0],
            token_ids.new_empty((logits.shape[0], 0)),
        )
    )
    return chosen, top_values, top_ids


def expand_logits(reduced: torch.Tensor, draft_vocab: torch.Tensor, vocab_size: int):
    """A reduced head's logits [n, draft vocab] as float32 logits over the target's whole
    vocabulary, -inf outside the draft vocabulary (q is zero there)."""
    full = reduced.new_full((reduced.shape[0], vocab_size), float("-inf"), dtype=torch.float32)
    return full.index_copy_(1, draft_vocab, reduced.float())
