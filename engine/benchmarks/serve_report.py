"""Text reports of `specserve bench serve`: one run, a sweep curve, two files compared."""

from __future__ import annotations

import math

from engine.benchmarks.serve_stats import STAT_KEYS

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def server_info(info) -> dict:
    """The ModelInfo fields a reader needs to tell two result files apart."""
    return {
        "model": info.model,
        "draft_model": info.draft_model,
        "speculative_method": info.speculative_method,
        "num_speculative_tokens": info.num_speculative_tokens,
        "max_num_seqs": info.max_num_seqs,
        "num_kv_blocks": info.num_kv_blocks,
        "max_model_len": info.max_model_len,
    }


def format_result(result: dict) -> str:
    head = _header(result)
    if result["kind"] == "run":
        return "\n".join([head, format_summary(result["summary"])])
    return "\n".join([head, format_sweep(result)])


def format_summary(s: dict) -> str:
    lines = [
        f"requests      {s['num_completed']} completed, {s['num_errors']} errors "
        f"in {s['duration_s']:.2f} s",
        f"throughput    {s['request_throughput']:.3f} req/s, "
        f"{s['output_throughput']:.1f} output tok/s",
        f"goodput       {s['goodput']:.3f} req/s (SLO attainment {_pct(s['slo_attainment'])})",
        f"speculation   acceptance rate {_pct(s['acceptance_rate'])} "
        f"({s['num_accepted_tokens']}/{s['num_draft_tokens']} draft tokens)",
    ]
    if "valid_json" in s:
        lines.append(f"structured    answers that parse and validate {_pct(s['valid_json'])}")
    lines.append(f"{'latency ms':<14}" + "".join(f"{k:>10}" for k in STAT_KEYS))
    for key, name in LATENCIES:
        lines.append(f"  {name:<12}" + "".join(f"{_num(s[key][k]):>10}" for k in STAT_KEYS))
    if s["errors"]:
        lines.append("errors        " + ", ".join(f"{k}: {v}" for k, v in s["errors"].items()))
    return "\n".join(lines)


def format_sweep(result: dict) -> str:
    head = (
        f"{'concurrency':>11}{'req/s':>9}{'tok/s':>9}{'goodput':>9}{'TTFT p50':>10}"
        f"{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}{'E2E p50':>10}{'errors':>8}"
    )
    lines = [head, "-" * len(head)]
    for level in result["levels"]:
        s = level["summary"]
        mark = "  <- knee" if level["concurrency"] == result["knee_concurrency"] else ""
        lines.append(
            f"{level['concurrency']:>11}{s['request_throughput']:>9.3f}"
            f"{s['output_throughput']:>9.1f}{s['goodput']:>9.3f}"
            f"{_num(s['ttft_ms']['median']):>10}{_num(s['ttft_ms']['p99']):>10}"
            f"{_num(s['tpot_ms']['median']):>10}{_num(s['tpot_ms']['p99']):>10}"
            f"{_num(s['e2e_ms']['median']):>10}{s['num_errors']:>8}{mark}"
        )
    knee = result["knee_concurrency"]
    lines.append(f"knee: concurrency {knee}, the first level within 90% of the peak throughput")
    if knee == result["levels"][-1]["concurrency"] and len(result["levels"]) > 1:
        lines.append("  (throughput still rising at the last level: extend the sweep)")
    search = result.get("rate_search")
    if search:
        for r in search["runs"]:
            s = r["summary"]
            lines.append(
                f"  rate {r['request_rate']:.3f}/s: attainment "
                f"{_pct(s['slo_attainment'])}, TTFT p99 {_num(s['ttft_ms']['p99'])} "
                f"ms, TPOT p99 {_num(s['tpot_ms']['p99'])} ms -> "
                f"{'meets' if r['meets_slo'] else 'misses'} the SLO"
            )
        lines.append("highest request rate meeting the SLO: " + _best_rate(search))
    return "\n".join(lines)


def _best_rate(search: dict) -> str:
    best = search["max_request_rate"]
    if best is None:
        return "none of the rates tried"
    if all(r["meets_slo"] for r in search["runs"]):
        return f">= {best:.3f} req/s (every rate tried met it; add --rate-search-steps)"
    return f"{best:.3f} req/s"


def format_compare(results: list[dict]) -> str:
    """Side by side with the ratio B/A, per metric (per concurrency level for sweeps)."""
    a, b = (_metrics(r) for r in results)
    names = [_label(r, i) for i, r in enumerate(results)]
    head = f"{'metric':<34}{names[0][:14]:>16}{names[1][:14]:>16}{'B/A':>9}"
    lines = [head, "-" * len(head)]
    for key in [k for k in a if k in b]:
        ratio = f"{b[key] / a[key]:.2f}x" if a[key] else "-"
        lines.append(f"{key:<34}{_num(a[key]):>16}{_num(b[key]):>16}{ratio:>9}")
    return "\n".join(lines)


def _metrics(result: dict) -> dict[str, float]:
    if result["kind"] == "run":
        return _summary_metrics(result["summary"], "")
    out: dict[str, float] = {}
    for level in result["levels"]:
        out.update(_summary_metrics(level["summary"], f"c={level['concurrency']} "))
    best = (result.get("rate_search") or {}).get("max_request_rate")
    if best is not None:
        out["max rate meeting SLO req/s"] = best
    return out


def _summary_metrics(s: dict, prefix: str) -> dict[str, float]:
    out = {
        f"{prefix}req/s": s["request_throughput"],
        f"{prefix}output tok/s": s["output_throughput"],
        f"{prefix}goodput req/s": s["goodput"],
        f"{prefix}acceptance rate": s["acceptance_rate"],
    }
    for key, name in LATENCIES:
        for stat in ("median", "p99") if prefix else STAT_KEYS:
            out[f"{prefix}{name} {stat} ms"] = s[key][stat]
    out[f"{prefix}errors"] = s["num_errors"]
    return out


def _header(result: dict) -> str:
    server, config = result["server"], result["config"]
    workload = f"dataset {config['dataset']}, seed {config['seed']}"
    if server.get("backend") == "openai":
        return f"OpenAI API {config['base_url']}: model {server['model']}; {workload}"
    return (
        f"server {config['server']}: {server['model'] or 'default model'}, speculation "
        f"{server['speculative_method']}; {workload}"
    )


def _label(result: dict, i: int) -> str:
    config, server = result.get("config", {}), result.get("server", {})
    if server.get("backend") == "openai":
        return config.get("label") or f"{'AB'[i]}: openai"
    return config.get("label") or f"{'AB'[i]}: spec {server.get('speculative_method', '?')}"


def _num(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if v is None or math.isnan(v):
        return "-"
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


def _pct(v: float) -> str:
    return "-" if v is None or math.isnan(v) else f"{100 * v:.1f}%"
