"""Two specserve workers behind the Shepherd Model Gateway: what the gateway costs, and
what cache-aware routing buys on a shared-prefix workload.

    .venv/bin/python scripts/bench_gateway.py overhead [--repeats 3] [--policy round_robin]
    .venv/bin/python scripts/bench_gateway.py prefix   [--repeats 3]

overhead: `specserve bench serve` at concurrency 1, 8 and 32 (chat prompts, 64 tokens)
straight to both workers over gRPC (`--server A,B`, round-robin) and through the gateway
(`--backend openai`, `--policy`: round_robin routes like the direct run, so the
difference is the gateway itself), alternating, `--repeats` times each; prints output
tok/s and mean TTFT, median and range, and the gateway/direct throughput ratio.

prefix: the shared-prefix workload (16 system prompts of ~400 tokens, random order,
concurrency 4) through the gateway with --policy cache_aware and with round_robin, on
workers whose KV pools hold about half the prefixes each; prints the workers' prefix-
cache hit rate (from their metrics) and TTFT.

Workers run the default model with one torch thread each (2 workers on 2 cores); the
gateway and the load generator share the same cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.benchmarks.report import median_range  # noqa: E402
from engine.client import SpecserveClient  # noqa: E402
from tests.gateway.gateway import Gateway  # noqa: E402
from tests.ops.scrape import parse, value  # noqa: E402
from tests.server.helpers import free_port  # noqa: E402

SPECSERVE = [sys.executable, "-m", "engine"]


class Worker:
    def __init__(self, *extra: str) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives with the process)
        args = [*SPECSERVE, "serve", "--host", "127.0.0.1", "--port", str(self.port),
                "--metrics-port", str(self.metrics_port), "--num-threads", "1",
                "--log-level", "WARNING",
                "--quantization", "none",  # the weights docs/benchmarks.md measured with
                *extra]  # fmt: skip
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)

    def prefix_counts(self) -> tuple[float, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics") as r:
            samples = parse(r.read())
        return (
            value(samples, "specserve_prefix_cache_hits_total"),
            value(samples, "specserve_prefix_cache_queries_total"),
        )

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def _bench(*args: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [*SPECSERVE, "bench", "serve", "--no-progress", "--json", out.name, *args]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())["summary"]


def _wait(workers: list[Worker]) -> None:
    for worker in workers:
        with SpecserveClient(worker.target) as client:
            client.wait_serving(600)


def _gateway(workers: list[Worker], policy: str) -> Gateway:
    # No --model-path: the gateway fetches the tokenizer from the workers.
    gateway = Gateway([w.target for w in workers], None, "--policy", policy)
    deadline = time.monotonic() + 120
    while gateway.num_healthy_workers() < len(workers):
        if time.monotonic() > deadline:
            raise RuntimeError(f"gateway did not take the workers:\n{gateway.output()[-2000:]}")
        time.sleep(0.2)
    return gateway


def overhead(repeats: int, policy: str) -> None:
    workers = [Worker(), Worker()]
    _wait(workers)
    gateway = _gateway(workers, policy)
    direct = ["--server", ",".join(w.target for w in workers)]
    through = ["--backend", "openai", "--base-url", f"http://127.0.0.1:{gateway.port}"]
    try:
        print("concurrency | direct tok/s | gateway tok/s | ratio | direct TTFT ms | "
              "gateway TTFT ms")  # fmt: skip
        for concurrency in (1, 8, 32):
            load = ["--dataset", "chat", "--output-len", "64", "--concurrency",
                    str(concurrency), "--num-requests", str(max(8, 2 * concurrency)),
                    "--warmup", str(min(concurrency, 8))]  # fmt: skip
            runs: dict[str, list[dict]] = {"direct": [], "gateway": []}
            for _ in range(repeats):
                runs["direct"].append(_bench(*direct, *load))
                runs["gateway"].append(_bench(*through, *load))
            tps = {k: [r["output_throughput"] for r in v] for k, v in runs.items()}
            ttft = {k: [r["ttft_ms"]["mean"] for r in v] for k, v in runs.items()}
            ratios = [g / d for g, d in zip(tps["gateway"], tps["direct"])]
            print(f"{concurrency} | {median_range(tps['direct'])} | "
                  f"{median_range(tps['gateway'])} | {statistics.median(ratios):.3f} "
                  f"({min(ratios):.3f}-{max(ratios):.3f}) | {median_range(ttft['direct'])} | "
                  f"{median_range(ttft['gateway'])}", flush=True)  # fmt: skip
    finally:
        gateway.stop()
        for worker in workers:
            worker.stop()


def prefix(repeats: int, policy: str) -> None:
    del policy  # both policies, side by side
    # 200 blocks of 16 tokens per worker: about 8 of the 16 prefixes (~25 blocks each).
    print("policy | prefix hit rate | mean TTFT ms | output tok/s")
    results: dict[str, list[tuple[float, float, float]]] = {}
    for _ in range(repeats):
        for policy in ("cache_aware", "round_robin"):
            workers = [Worker("--num-kv-blocks", "200"), Worker("--num-kv-blocks", "200")]
            _wait(workers)
            gateway = _gateway(workers, policy)
            try:
                before = [w.prefix_counts() for w in workers]
                summary = _bench("--backend", "openai", "--base-url",
                                 f"http://127.0.0.1:{gateway.port}", "--dataset",
                                 "shared-prefix", "--num-prefixes", "16", "--prefix-chars",
                                 "1600", "--output-len", "16", "--concurrency", "4",
                                 "--num-requests", "160", "--warmup", "0")  # fmt: skip
                after = [w.prefix_counts() for w in workers]
            finally:
                gateway.stop()
                for worker in workers:
                    worker.stop()
            hits = sum(a[0] - b[0] for a, b in zip(after, before))
            queries = sum(a[1] - b[1] for a, b in zip(after, before))
            row = (hits / queries, summary["ttft_ms"]["mean"], summary["output_throughput"])
            results.setdefault(policy, []).append(row)
            print(f"{policy} | {row[0]:.3f} | {row[1]:.0f} | {row[2]:.1f}", flush=True)
    for policy, rows in results.items():
        rates = [r[0] for r in rows]
        ttfts = [r[1] for r in rows]
        print(f"{policy}: hit rate median {statistics.median(rates):.3f} "
              f"({min(rates):.3f}-{max(rates):.3f}), TTFT ms {median_range(ttfts)}")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment", choices=("overhead", "prefix"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policy", default="round_robin", help="overhead: the gateway's policy")
    args = parser.parse_args()
    {"overhead": overhead, "prefix": prefix}[args.experiment](args.repeats, args.policy)
