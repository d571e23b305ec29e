"""Container HEALTHCHECK: exit 0 when the gRPC health service says SERVING.

grpc_health_probe is not in the image (no download at build time); this is the same
check in a few lines of Python, using only grpcio and grpcio-health-checking.

    python /opt/specserve/healthcheck.py [--port 50051] [--service specserve.v1.Generation]
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE = "specserve.v1.Generation"


def check(address: str, service: str, timeout_s: float) -> bool:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=service)
        response = stub.Check(request, timeout=timeout_s)
    return response.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--service", default=SERVICE)
    parser.add_argument("--timeout-s", type=float, default=3.0)
    args = parser.parse_args(argv)
    try:
        serving = check(f"{args.host}:{args.port}", args.service, args.timeout_s)
    except grpc.RpcError as exc:
        print(f"unhealthy: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if not serving:
        print("unhealthy: NOT_SERVING", file=sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
