"""The gRPC front door: ``specserve serve`` (see docs/grpc.md).

Modules, by concern: validation (proto -> SamplingParams), convert (engine -> proto),
servicer (the RPCs and error mapping), health, auth (API key, TLS), lifecycle (draining),
app (SpecserveServer), main (the blocking ``serve`` entry point and logging).
"""

from engine.server.app import ServerOptions, SpecserveServer

__all__ = ["ServerOptions", "SpecserveServer"]
