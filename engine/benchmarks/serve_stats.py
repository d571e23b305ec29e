"""Per-request measurements, arrival gaps and the summary of `specserve bench serve`.

Times are seconds on the client's monotonic clock, relative to the start of the run.

    send        first token           ...   last token
     |-- TTFT --|-- ITL --|-- ITL --| ... |
     |------------------ E2E ------------|
    TPOT = (E2E - TTFT) / (num_output_tokens - 1)

ITL is the gap between consecutive stream messages that carried tokens; with
speculation one message may carry several tokens, so TPOT <= mean ITL.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from dataclasses import dataclass, field

from engine.benchmarks.report import mean, percentile
from engine.benchmarks.workloads import valid_share

STAT_KEYS = ("mean", "median", "p90", "p99")
SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass(slots=True)
class RequestRecord:
    """What one request measured. `error` is a gRPC status name, None on success."""

    index: int
    start: float
    num_prompt_tokens: int = 0
    first_token: float | None = None
    end: float | None = None
    # Arrival time of every stream message that carried tokens, and its token count.
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    # Structured output (the json dataset): the schema sent, and the answer's text.
    json_schema: str | None = None
    text: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def num_output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        return tpot(self.e2e, self.ttft, self.num_output_tokens)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


def tpot(e2e: float | None, ttft: float | None, num_output_tokens: int) -> float | None:
    """Time per output token after the first: (e2e - ttft) / (n - 1); None for n < 2."""
    if e2e is None or ttft is None or num_output_tokens < 2:
        return None
    return (e2e - ttft) / (num_output_tokens - 1)


# ---- SLOs ----------------------------------------------------------------------------
def parse_slo(text: str | None) -> dict[str, float]:
    """Parse `ttft=500,tpot=50` into {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    if not text:
        return {}
    slo = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo takes KEY=MS pairs with KEY in {SLO_KEYS}, got {part!r}")
        slo[key] = float(value)
        if slo[key] <= 0:
            raise ValueError(f"--slo {key} must be > 0 ms, got {value}")
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """A successful request within every bound. No TPOT (one token) meets a TPOT bound."""
    if not record.ok:
        return False
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2e": record.e2e}
    return all(values[k] is None or values[k] * 1e3 <= bound for k, bound in slo.items())


# ---- arrivals ------------------------------------------------------------------------
class Arrivals:
    """Open-loop gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate,
    squared coefficient of variation 1/burstiness. burstiness 1 is a Poisson process;
    below 1 arrivals come in bursts, above 1 they are more regular."""

    def __init__(self, rate: float, burstiness: float = 1.0, seed: int = 0) -> None:
        if rate <= 0:
            raise ValueError(f"--request-rate must be > 0, got {rate}")
        if burstiness <= 0:
            raise ValueError(f"--burstiness must be > 0, got {burstiness}")
        self.rate = rate
        self.burstiness = burstiness
        # Its own stream, so the arrival process never shifts the workload's samples.
        self._rng = random.Random(seed ^ 0x5EED)

    def next_gap(self) -> float:
        return self._rng.gammavariate(self.burstiness, 1.0 / (self.rate * self.burstiness))


# ---- summary -------------------------------------------------------------------------
def dist_ms(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values_s]
    return {
        "mean": mean(ms),
        "median": percentile(ms, 50),
        "p90": percentile(ms, 90),
        "p99": percentile(ms, 99),
    }


def summarize(
    records: list[RequestRecord], duration_s: float, slo: dict[str, float]
) -> dict[str, object]:
    """The run's numbers (see the module docstring for the definitions)."""
    done = [r for r in records if r.ok]
    num_draft = sum(r.num_draft_tokens for r in done)
    num_accepted = sum(r.num_accepted_tokens for r in done)
    num_output = sum(r.num_output_tokens for r in done)
    num_good = sum(meets_slo(r, slo) for r in done)
    return {
        "duration_s": duration_s,
        "num_requests": len(records),
        "num_completed": len(done),
        "num_errors": len(records) - len(done),
        "errors": dict(Counter(r.error or "INCOMPLETE" for r in records if not r.ok)),
        "num_prompt_tokens": sum(r.num_prompt_tokens for r in done),
        "num_output_tokens": num_output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": num_output / duration_s,
        "goodput": num_good / duration_s,
        "slo_attainment": num_good / len(records) if records else math.nan,
        "ttft_ms": dist_ms([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": dist_ms([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": dist_ms([x for r in done for x in r.itls]),
        "e2e_ms": dist_ms([r.e2e for r in done if r.e2e is not None]),
        "num_draft_tokens": num_draft,
        "num_accepted_tokens": num_accepted,
        "acceptance_rate": num_accepted / num_draft if num_draft else 0.0,
        **_validity(done),
    }


def _validity(done: list[RequestRecord]) -> dict[str, float]:
    """The share of completed constrained answers that parse and validate (json dataset)."""
    held = [r for r in done if r.json_schema is not None]
    if not held:
        return {}
    answers = ["".join(r.text) for r in held]
    return {"valid_json": valid_share(answers, [json.loads(r.json_schema) for r in held])}


def throughput_timeline(records: list[RequestRecord], bin_s: float = 1.0) -> list[float]:
    """Output tokens per second in consecutive bins of `bin_s` from the run's start."""
    times = [(t, n) for r in records for t, n in zip(r.chunk_times, r.chunk_tokens, strict=True)]
    if not times:
        return []
    bins = [0.0] * (int(max(t for t, _ in times) / bin_s) + 1)
    for t, n in times:
        bins[int(t / bin_s)] += n / bin_s
    return bins


def knee_index(throughputs: list[float], saturation: float = 0.9) -> int:
    """The first level (levels in increasing concurrency) that reaches `saturation` of
    the peak throughput: past it, more concurrency buys little throughput and costs
    latency. The last level means the curve is still rising: extend the sweep."""
    peak = max(throughputs)
    return next(i for i, x in enumerate(throughputs) if x >= saturation * peak)
