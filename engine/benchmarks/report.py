"""Summaries shared by the benchmarks: percentiles, per-run results, the table."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def median_range(values: list[float], fmt: str = "{:.1f}") -> str:
    """ "median (min-max)" of repeated runs, each formatted with ``fmt``; the value alone
    for one run."""
    median = fmt.format(statistics.median(values))
    if len(values) == 1:
        return median
    return f"{median} ({fmt.format(min(values))}-{fmt.format(max(values))})"


@dataclass
class RequestTiming:
    start: float
    first_token: float | None = None
    end: float | None = None
    num_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        if self.first_token is None or self.end is None or self.num_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.num_tokens - 1)


@dataclass
class RunResult:
    system: str
    duration_s: float
    num_requests: int
    num_output_tokens: int
    ttft_ms: dict[str, float] = field(default_factory=dict)
    tpot_ms: dict[str, float] = field(default_factory=dict)
    spec: dict[str, float] = field(default_factory=dict)
    step_overhead_ms: float | None = None

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.duration_s

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.duration_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d["output_tokens_per_s"] = self.output_tokens_per_s
        d["requests_per_s"] = self.requests_per_s
        return d


def summarize(system: str, duration: float, timings: list[RequestTiming]) -> RunResult:
    ttfts = [t.ttft * 1e3 for t in timings if t.ttft is not None]
    tpots = [t.tpot * 1e3 for t in timings if t.tpot is not None]
    return RunResult(
        system=system,
        duration_s=duration,
        num_requests=len(timings),
        num_output_tokens=sum(t.num_tokens for t in timings),
        ttft_ms=_dist(ttfts),
        tpot_ms=_dist(tpots),
    )


def _dist(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {"mean": mean(values), "p50": percentile(values, 50), "p99": percentile(values, 99)}


def _fmt(d: dict[str, float]) -> str:
    if not d:
        return "-"
    return f"{d['mean']:.0f}/{d['p50']:.0f}/{d['p99']:.0f}"


def format_table(results: list[RunResult], reference: RunResult | None = None) -> str:
    head = (
        f"{'system':<34}{'tok/s':>9}{'req/s':>8}{'TTFT ms mean/p50/p99':>23}"
        f"{'TPOT ms mean/p50/p99':>23}{'ratio':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        ratio = (
            ""
            if reference is None
            else f"{r.output_tokens_per_s / reference.output_tokens_per_s:.2f}x"
        )
        lines.append(
            f"{r.system:<34}{r.output_tokens_per_s:>9.1f}{r.requests_per_s:>8.2f}"
            f"{_fmt(r.ttft_ms):>23}{_fmt(r.tpot_ms):>23}{ratio:>8}"
        )
    return "\n".join(lines)
