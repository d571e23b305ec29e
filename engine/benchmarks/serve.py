"""`specserve bench serve --server HOST:PORT`: load-test a running server over gRPC, or
through an OpenAI-compatible HTTP server such as the Shepherd Model Gateway.

    specserve bench serve --server localhost:50051 --concurrency 8 --num-requests 200
    specserve bench serve --backend openai --base-url http://localhost:30000 \\
        --dataset chat --concurrency 8 --num-requests 200
    specserve bench serve --server localhost:50051 --request-rate 4 --burstiness 0.5 \\
        --duration 60 --slo ttft=500,tpot=50 --json run.json --plot plots/
    specserve bench serve --server localhost:50051 --sweep 1,4,16 --slo ttft=2000,tpot=100
    specserve bench serve --compare none.json ngram.json

Each request is one streamed Generate (gRPC) or one SSE stream of /v1/chat/completions
or /v1/completions (--backend openai; see engine/benchmarks/serve_openai.py). The report
gives request and output-token throughput, TTFT / TPOT / ITL / E2E (mean, median, p90,
p99), goodput against the SLO, the server-reported acceptance rate of draft tokens and the
errors by status code. Definitions: engine/benchmarks/serve_stats.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from pathlib import Path

from engine.benchmarks import serve_openai, serve_openai_setup, serve_report
from engine.benchmarks.serve_runner import GrpcTransport, LoadShape, RequestOptions, make_clients
from engine.benchmarks.serve_stats import parse_slo
from engine.benchmarks.serve_sweep import Bench, build_workload
from engine.benchmarks.serve_workload import DATASETS

DEFAULT_NUM_REQUESTS = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    g = parser.add_argument_group("connection")
    g.add_argument(
        "--backend",
        choices=("grpc", "openai"),
        default="grpc",
        help="grpc: specserve's Generate (--server); openai: OpenAI HTTP streaming, e.g. "
        "through the Shepherd Model Gateway (--base-url)",
    )
    g.add_argument(
        "--server",
        default=None,
        help="HOST:PORT of a running specserve server; several, comma-separated, share the "
        "requests round-robin (direct gRPC to many replicas)",
    )
    g.add_argument("--base-url", default=None, help="openai: http[s]://HOST:PORT of the OpenAI API")
    g.add_argument(
        "--endpoint",
        choices=serve_openai.ENDPOINTS,
        default="auto",
        help="openai: chat for /v1/chat/completions, completions for /v1/completions; "
        "auto: chat for text prompts with the chat template, completions otherwise",
    )
    g.add_argument(
        "--model-name", default=None, help="openai: the model (default: the one /v1/models lists)"
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR_OR_HUB_ID",
        help="openai: the model's tokenizer, for --dataset synthetic/sharegpt "
        "(default: the served model name)",
    )
    g.add_argument(
        "--wait-ready",
        type=float,
        default=180.0,
        metavar="SECONDS",
        help="wait this long for the server to report SERVING or list a model (default 180)",
    )
    g.add_argument(
        "--api-key", default=None, help="bearer token (gRPC metadata; HTTP Authorization)"
    )
    g.add_argument("--api-key-file", default=None, help="read the bearer token from this file")
    g.add_argument("--tls", action="store_true", help="TLS with the system root certificates")
    g.add_argument("--tls-ca-cert", default=None, help="PEM CA bundle to verify the server")
    g.add_argument("--tls-client-cert", default=None, help="PEM client certificate (mTLS)")
    g.add_argument("--tls-client-key", default=None, help="PEM client private key (mTLS)")
    g.add_argument(
        "--tls-server-name", default=None, help="expected server name when it differs from HOST"
    )
    g.add_argument(
        "--num-channels",
        type=int,
        default=1,
        help="spread requests over this many connections (default 1)",
    )

    g = parser.add_argument_group("workload")
    g.add_argument(
        "--dataset",
        choices=DATASETS,
        default="synthetic",
        help="synthetic token prompts of --input-len; built-in chat or grounded "
        "prompts; a JSONL or ShareGPT file (--dataset-path); shared-prefix: questions "
        "behind --num-prefixes long system prompts",
    )
    g.add_argument("--dataset-path", default=None, help="file for --dataset jsonl/sharegpt")
    g.add_argument(
        "--num-prefixes",
        type=int,
        default=8,
        help="shared-prefix: how many distinct system prompts the requests share",
    )
    g.add_argument(
        "--prefix-chars",
        type=int,
        default=1600,
        help="shared-prefix: characters per system prompt (about 4 per token in English)",
    )
    g.add_argument("--input-len", type=int, default=128, help="synthetic prompt tokens")
    g.add_argument(
        "--output-len",
        type=int,
        default=64,
        help="max_tokens per request (ShareGPT: the reference reply's length)",
    )
    g.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)] (default 0: fixed)",
    )
    g.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    g.add_argument(
        "--no-chat-template",
        action="store_true",
        help="send text prompts as plain text, not as a user chat message",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy decoding")
    g.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="stop at EOS (default: generate exactly max_tokens)",
    )
    g.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="per-request speculation: 0 off, k fixed (default: server policy)",
    )
    g.add_argument("--request-timeout", type=float, default=None, help="deadline, seconds")

    g = parser.add_argument_group("load")
    g.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="closed loop: this many requests in flight (default 1)",
    )
    g.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="open loop: requests per second, Poisson arrivals",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 Poisson, <1 bursty, >1 regular",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="cap on requests in flight (open loop: arrivals wait)",
    )
    g.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help=f"measured requests (default {DEFAULT_NUM_REQUESTS} without --duration)",
    )
    g.add_argument(
        "--duration", type=float, default=None, help="stop sending after this many seconds"
    )
    g.add_argument("--warmup", type=int, default=0, help="unmeasured requests sent first")
    g.add_argument(
        "--sweep",
        default=None,
        metavar="C1,C2,...",
        help="closed-loop run per concurrency level, then (with --slo) search "
        "the highest request rate that meets the SLO",
    )
    g.add_argument(
        "--rate-search-steps",
        type=int,
        default=3,
        help="open-loop runs of the --sweep rate search (default 3)",
    )

    g = parser.add_argument_group("report")
    g.add_argument(
        "--slo",
        default=None,
        metavar="ttft=MS,tpot=MS",
        help="goodput counts requests within every bound (keys ttft, tpot, e2e)",
    )
    g.add_argument(
        "--slo-attainment",
        type=float,
        default=0.9,
        help="a rate meets the SLO when this fraction of requests does (0.9)",
    )
    g.add_argument("--label", default=None, help="name of this run in --compare tables")
    g.add_argument("--json", default=None, help="write the results to this JSON file")
    g.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts here")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    g.add_argument(
        "--compare",
        nargs=2,
        default=None,
        metavar=("A.json", "B.json"),
        help="print two result files side by side with B/A ratios, then exit",
    )


def run(args: argparse.Namespace) -> int:
    if args.compare:
        results = [json.loads(Path(p).read_text()) for p in args.compare]
        print(serve_report.format_compare(results))
        _plot(args.plot, results)
        return 0
    if args.backend == "grpc" and not args.server:
        raise ValueError("--server HOST:PORT is required (or --compare A.json B.json)")
    if args.backend == "grpc" and args.base_url:
        raise ValueError("--base-url is for --backend openai; --backend grpc takes --server")
    result = asyncio.run(_bench(args))
    print(serve_report.format_result(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    _plot(args.plot, [result])
    return 0


async def _wait_ready(client, target: str, timeout_s: float) -> None:
    """A server started just before this command is still loading its model."""
    try:
        if await client.health(timeout=5.0) == "SERVING":
            return
    except Exception:  # noqa: BLE001 - refused / unavailable: wait below
        pass
    print(f"waiting for {target} to report SERVING...", file=sys.stderr, flush=True)
    await client.wait_serving(timeout_s)


async def _bench(args: argparse.Namespace) -> dict:
    slo = parse_slo(args.slo)
    connect = serve_openai_setup.connect if args.backend == "openai" else _connect_grpc
    async with connect(args, _api_key(args)) as (transport, workload, server):
        bench = Bench(transport, workload, slo, args.slo_attainment, progress=not args.no_progress)
        await bench.warmup(args.warmup, args.concurrency or args.max_concurrency or 1)
        if args.sweep:
            result = await bench.sweep(
                _levels(args.sweep), _shape(args, concurrency=1), args.rate_search_steps
            )
        else:
            result = await bench.single(_shape(args))
    result["config"] = _config(args, slo)
    result["server"] = server
    return result


@contextlib.asynccontextmanager
async def _connect_grpc(args: argparse.Namespace, api_key: str | None):
    """(transport, workload, server info) for `bench serve --server HOST:PORT`."""
    clients = make_clients(args.server, args.num_channels, api_key, _tls(args))
    try:
        targets = args.server.split(",")
        for client, target in zip(clients, targets):  # the first len(targets) are distinct
            await _wait_ready(client, target.strip(), args.wait_ready)
        info = await clients[0].model_info(timeout=60)
        workload = await build_workload(args, clients[0], info.max_model_len)
        transport = GrpcTransport(clients, _request_options(args))
        yield transport, workload, serve_report.server_info(info)
    finally:
        for client in clients:
            await client.close()


def _shape(args: argparse.Namespace, **override) -> LoadShape:
    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        num_requests = DEFAULT_NUM_REQUESTS
    concurrency = args.concurrency
    if concurrency is None and args.request_rate is None:
        concurrency = 1
    fields = dict(
        concurrency=concurrency,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        num_requests=num_requests,
        duration_s=args.duration,
        seed=args.seed,
    )
    if "concurrency" in override:
        fields["request_rate"] = None
    return LoadShape(**{**fields, **override})


def _request_options(args: argparse.Namespace) -> RequestOptions:
    return RequestOptions(
        temperature=args.temperature,
        ignore_eos=not args.no_ignore_eos,
        chat_template=not args.no_chat_template,
        num_speculative_tokens=args.num_speculative_tokens,
        timeout_s=args.request_timeout,
    )


def _levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise ValueError(f"--sweep takes concurrency levels >= 1, got {text!r}")
    return sorted(set(levels))


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file:
        return Path(args.api_key_file).read_text().strip()
    return args.api_key


def _tls(args: argparse.Namespace):
    from engine.client import TlsConfig

    files = (args.tls_ca_cert, args.tls_client_cert, args.tls_client_key)
    if not args.tls and not any(files) and not args.tls_server_name:
        return False
    return TlsConfig(
        ca_cert=args.tls_ca_cert,
        client_cert=args.tls_client_cert,
        client_key=args.tls_client_key,
        server_name=args.tls_server_name,
    )


def _config(args: argparse.Namespace, slo: dict[str, float]) -> dict:
    keys = (
        "backend",
        "server",
        "base_url",
        "endpoint",
        "model_name",
        "dataset",
        "dataset_path",
        "num_prefixes",
        "prefix_chars",
        "input_len",
        "output_len",
        "range_ratio",
        "seed",
        "temperature",
        "concurrency",
        "request_rate",
        "burstiness",
        "max_concurrency",
        "num_requests",
        "duration",
        "warmup",
        "sweep",
        "num_speculative_tokens",
        "num_channels",
        "label",
    )
    config = {k: getattr(args, k) for k in keys}
    config["tls"] = _tls(args) is not False
    config["slo_ms"] = slo
    config["slo_attainment"] = args.slo_attainment
    return config


def _plot(out_dir: str | None, results: list[dict]) -> None:
    if not out_dir:
        return
    from engine.benchmarks.serve_plot import plot_results

    for path in plot_results(results, Path(out_dir)):
        print(f"wrote {path}", file=sys.stderr)
