"""``specserve serve``: the gRPC server (engine/server)."""

from __future__ import annotations

import argparse

from engine.entrypoints.args import add_engine_args, engine_config_from_args
from engine.observability.metrics import add_ops_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    add_ops_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    g.add_argument("--port", type=int, default=50051, help="port (default 50051; 0 = any)")
    g.add_argument("--no-reflection", action="store_true", help="turn off server reflection")
    g.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long running streams may finish (default 30)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'authorization: Bearer KEY' (health and reflection exempt)",
    )
    g.add_argument(
        "--api-key-file",
        default=None,
        help="read the API keys from this file, one a line: each caller its own key (a "
        "caller's Abort reaches only requests sent with its key)",
    )
    g.add_argument("--tls-cert", default=None, help="PEM server certificate chain (TLS)")
    g.add_argument("--tls-key", default=None, help="PEM server private key (TLS)")
    g.add_argument(
        "--tls-client-ca",
        default=None,
        help="PEM CA bundle; clients must present a certificate it signed (mTLS)",
    )
    g.add_argument(
        "--max-message-mib",
        type=int,
        default=16,
        help="max request/response message size in MiB (default 16)",
    )
    g.add_argument(
        "--keepalive-time-s",
        type=float,
        default=60.0,
        help="server keepalive ping interval (default 60)",
    )
    g.add_argument(
        "--keepalive-timeout-s",
        type=float,
        default=20.0,
        help="close a connection whose ping is unanswered this long (default 20)",
    )
    g.add_argument(
        "--max-connection-age-s",
        type=float,
        default=300.0,
        help="send GOAWAY after this long so clients rebalance (default 300)",
    )
    g.add_argument(
        "--max-connection-age-grace-s",
        type=float,
        default=30.0,
        help="calls in flight at GOAWAY get this long to finish (default 30)",
    )
    g.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="least severe log level written",
    )


def run(args: argparse.Namespace) -> int:
    from engine.observability.request_log import setup_logging
    from engine.server.app import ServerOptions
    from engine.server.auth import load_api_key
    from engine.server.main import serve

    setup_logging(args.log_format, args.log_level)
    options = ServerOptions(
        host=args.host,
        port=args.port,
        reflection=not args.no_reflection,
        shutdown_grace_s=args.shutdown_grace,
        api_key=load_api_key(args.api_key, args.api_key_file),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        max_message_mib=args.max_message_mib,
        keepalive_time_s=args.keepalive_time_s,
        keepalive_timeout_s=args.keepalive_timeout_s,
        max_connection_age_s=args.max_connection_age_s,
        max_connection_age_grace_s=args.max_connection_age_grace_s,
    )
    return serve(engine_config_from_args(args), options, setup=lambda s: _observe(s, args))


def _observe(server, args: argparse.Namespace) -> None:
    """Prometheus metrics and request logs, hung on the server's hooks."""
    from engine.observability.metrics import EngineMetrics
    from engine.observability.request_log import RequestLogger

    metrics = EngineMetrics()
    request_logger = RequestLogger(json=args.log_format == "json", log_prompts=args.log_prompts)
    server.engine.step_observers += [metrics.observe_step, request_logger.observe_step]
    server.engine.failure_observers.append(metrics.on_engine_failed)
    server.on_rpc_error = metrics.on_rpc_error
    server.on_rpc_failure = request_logger.on_rpc_error
    server.on_admission_rejected = metrics.on_admission_rejected
    if args.metrics_port:
        _start_metrics_server(metrics, args.metrics_port)


def _start_metrics_server(metrics, port: int) -> None:
    import errno

    from engine.server.ports import PortInUseError

    try:
        metrics.start_http_server(port)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise PortInUseError(port, "--metrics-port") from None
