"""Statistics of `specserve bench serve` against hand-computed values, and the arrival
process against the gamma distribution it claims."""

from __future__ import annotations

import math
import statistics

import pytest

from engine.benchmarks.report import percentile
from engine.benchmarks.serve_stats import (
    Arrivals,
    RequestRecord,
    dist_ms,
    knee_index,
    meets_slo,
    parse_slo,
    summarize,
    throughput_timeline,
    tpot,
)


def record(index, start, chunks, *, draft=0, accepted=0, error=None) -> RequestRecord:
    """chunks: [(arrival time s, tokens)]; the stream ends at the last chunk."""
    r = RequestRecord(index, start, num_prompt_tokens=10)
    r.chunk_times = [t for t, _ in chunks]
    r.chunk_tokens = [n for _, n in chunks]
    r.first_token = r.chunk_times[0] if chunks else None
    r.end = None if error else (r.chunk_times[-1] if chunks else start)
    r.num_draft_tokens, r.num_accepted_tokens, r.error = draft, accepted, error
    return r


def test_percentile_interpolates_linearly():
    values = [50.0, 10.0, 40.0, 20.0, 30.0]
    assert percentile(values, 50) == 30.0
    assert percentile(values, 90) == pytest.approx(46.0)  # pos 3.6: 40 + 0.6 * 10
    assert percentile(values, 99) == pytest.approx(49.6)  # pos 3.96
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert math.isnan(percentile([], 50))


def test_dist_ms_converts_and_summarizes():
    d = dist_ms([0.010, 0.020, 0.030, 0.040])
    assert d == pytest.approx({"mean": 25.0, "median": 25.0, "p90": 37.0, "p99": 39.7})


def test_request_timings_and_tpot_formula():
    # sent at 1.0; tokens: 1 at 1.2, 2 at 1.3, 1 at 1.5 -> 4 tokens
    r = record(0, 1.0, [(1.2, 1), (1.3, 2), (1.5, 1)])
    assert r.ttft == pytest.approx(0.2)
    assert r.e2e == pytest.approx(0.5)
    assert r.num_output_tokens == 4
    assert r.tpot == pytest.approx((0.5 - 0.2) / (4 - 1))  # 0.1 s
    assert r.itls == pytest.approx([0.1, 0.2])
    assert tpot(0.5, 0.2, 1) is None
    assert tpot(None, 0.2, 5) is None


def test_slo_parse_and_goodput():
    assert parse_slo("ttft=250, tpot=120") == {"ttft": 250.0, "tpot": 120.0}
    assert parse_slo(None) == {}
    for bad in ("ttft", "latency=5", "tpot=0"):
        with pytest.raises(ValueError):
            parse_slo(bad)
    slo = {"ttft": 250.0, "tpot": 120.0}
    records = [
        record(0, 0.0, [(0.2, 1), (0.5, 3)]),  # TTFT 200, TPOT 100: good
        record(1, 0.0, [(0.3, 1), (0.4, 3)]),  # TTFT 300: late
        record(2, 0.0, [(0.1, 1), (0.6, 3)]),  # TPOT 166.7: slow
        record(3, 0.0, [(0.25, 1)]),  # TTFT 250 (bound inclusive), one token: good
        record(4, 0.0, [], error="RESOURCE_EXHAUSTED"),
    ]
    assert [meets_slo(r, slo) for r in records] == [True, False, False, True, False]
    s = summarize(records, duration_s=2.0, slo=slo)
    assert s["num_completed"] == 4 and s["num_errors"] == 1
    assert s["errors"] == {"RESOURCE_EXHAUSTED": 1}
    assert s["goodput"] == pytest.approx(2 / 2.0)
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    assert s["request_throughput"] == pytest.approx(4 / 2.0)
    assert s["output_throughput"] == pytest.approx((4 + 4 + 4 + 1) / 2.0)
    assert s["ttft_ms"]["median"] == pytest.approx(225.0)  # 100, 200, 250, 300
    # TPOTs 100, 33.3, 166.7 (record 3 has none)
    assert s["tpot_ms"]["mean"] == pytest.approx((100 + 100 / 3 + 500 / 3) / 3)


def test_acceptance_rate_sums_over_requests():
    records = [
        record(0, 0.0, [(0.1, 3)], draft=8, accepted=6),
        record(1, 0.0, [(0.1, 3)], draft=4, accepted=0),
    ]
    s = summarize(records, 1.0, {})
    assert (s["num_draft_tokens"], s["num_accepted_tokens"]) == (12, 6)
    assert s["acceptance_rate"] == pytest.approx(0.5)
    assert s["goodput"] == s["request_throughput"]  # no SLO: every success counts


def test_throughput_timeline_bins_tokens_by_arrival():
    records = [record(0, 0.0, [(0.5, 2), (1.5, 3)]), record(1, 0.0, [(1.9, 1), (2.1, 4)])]
    assert throughput_timeline(records) == [2.0, 4.0, 4.0]
    assert throughput_timeline(records, bin_s=0.5) == [0.0, 4.0, 0.0, 8.0, 8.0]


def test_knee_is_first_level_near_peak_throughput():
    assert knee_index([100.0, 300.0, 560.0, 600.0]) == 2  # 560 >= 0.9 * 600
    assert knee_index([100.0, 200.0, 400.0]) == 2  # still rising: the last level


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrival_gaps_follow_gamma(burstiness: float):
    """Mean gap 1/rate for any burstiness; CV^2 = 1/burstiness (Poisson: CV 1)."""
    rate = 5.0
    arrivals = Arrivals(rate, burstiness, seed=123)
    gaps = [arrivals.next_gap() for _ in range(20_000)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / rate, rel=0.03)
    cv2 = statistics.pvariance(gaps) / mean**2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.1)


def test_arrivals_are_reproducible_and_validated():
    a, b = Arrivals(2.0, seed=7), Arrivals(2.0, seed=7)
    assert [a.next_gap() for _ in range(5)] == [b.next_gap() for _ in range(5)]
    assert Arrivals(2.0, seed=8).next_gap() != Arrivals(2.0, seed=7).next_gap()
    for rate, burstiness in ((0.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            Arrivals(rate, burstiness)


def test_median_range_of_repeated_runs():
    from engine.benchmarks.report import median_range

    assert median_range([3.0, 1.0, 2.0]) == "2.0 (1.0-3.0)"
    assert median_range([1.5, 2.5], "{:.2f}x") == "2.00x (1.50x-2.50x)"  # even: the mean of two
    assert median_range([7.25]) == "7.2"  # one run: no range
