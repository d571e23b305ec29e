"""PNG charts of `specserve bench serve` results (matplotlib, imported only for --plot).

One or more result files on the same axes: latency CDFs and output-token throughput
over time for runs; the throughput/latency curve over concurrency for sweeps.
"""

from __future__ import annotations

from pathlib import Path

from engine.benchmarks.serve_report import LATENCIES


def plot_results(results: list[dict], out_dir: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    out_dir.mkdir(parents=True, exist_ok=True)
    labels = [_label(r, i) for i, r in enumerate(results)]
    runs = [_busiest_run(r) for r in results]
    paths = [
        _latency_cdfs(runs, labels, out_dir / "latency_cdf.png"),
        _timeline(runs, labels, out_dir / "throughput_over_time.png"),
    ]
    if all(r["kind"] == "sweep" for r in results):
        paths.append(_sweep_curve(results, labels, out_dir / "sweep.png"))
    return paths


def _busiest_run(result: dict) -> dict:
    """A sweep's CDFs and timeline come from its highest concurrency level."""
    return result if result["kind"] == "run" else result["levels"][-1]


def _latency_cdfs(runs: list[dict], labels: list[str], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, name) in zip(axes.flat, LATENCIES, strict=True):
        for run, label in zip(runs, labels, strict=True):
            values = sorted(_values(run["requests"], key))
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if key != "itl_ms" else "fraction of gaps")
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    fig.suptitle("Latency CDFs")
    return _save(fig, path)


def _timeline(runs: list[dict], labels: list[str], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for run, label in zip(runs, labels, strict=True):
        series = run["throughput_timeline_tok_s"]
        ax.plot(range(len(series)), series, label=label)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens / s (1 s bins)")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _sweep_curve(results: list[dict], labels: list[str], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for result, label in zip(results, labels, strict=True):
        levels = [lv["concurrency"] for lv in result["levels"]]
        s = [lv["summary"] for lv in result["levels"]]
        tok_s = [x["output_throughput"] for x in s]
        (line,) = left.plot(levels, tok_s, marker="o", label=label)
        knee = levels.index(result["knee_concurrency"])
        left.plot([levels[knee]], [tok_s[knee]], marker="*", markersize=14, color="k")
        for stat, style in (("median", "-"), ("p99", "--")):
            tpot = [x["tpot_ms"][stat] for x in s]
            right.plot(
                tok_s, tpot, style, marker="o", color=line.get_color(), label=f"{label} TPOT {stat}"
            )
    left.set(
        xscale="log",
        xlabel="concurrency",
        ylabel="output tokens / s",
        title="Throughput (* = knee)",
    )
    all_levels = sorted({lv["concurrency"] for r in results for lv in r["levels"]})
    left.set_xticks(all_levels, [str(c) for c in all_levels])
    left.minorticks_off()
    right.set(xlabel="output tokens / s", ylabel="TPOT (ms)", title="Latency vs throughput")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def _values(requests: list[dict], key: str) -> list[float]:
    if key == "itl_ms":
        return [x for r in requests for x in r["itl_ms"] if x is not None]
    return [r[key] for r in requests if r[key] is not None]


def _label(result: dict, i: int) -> str:
    config, server = result.get("config", {}), result.get("server", {})
    return config.get("label") or f"spec {server.get('speculative_method', '?')} ({i})"


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
