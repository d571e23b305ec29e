"""The gRPC front door: ``specserve serve`` (see docs/grpc.md).

Modules, by concern: validation (proto -> SamplingParams), convert (engine -> proto),
servicer (the specserve.v1 RPCs), rpc_guard (drain, error mapping and reporting for every
RPC), vllm_* (vllm.grpc.engine.VllmEngine for the smg gateway: request, convert, loads,
kv_events, tokenizer, servicer), health, auth (API key, TLS), lifecycle (draining), app
(SpecserveServer), main (the blocking ``serve`` entry point and logging).
"""

from engine.server.app import ServerOptions, SpecserveServer

__all__ = ["ServerOptions", "SpecserveServer"]
