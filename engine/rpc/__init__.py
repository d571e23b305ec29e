"""Generated gRPC stubs for proto/specserve/v1 (regenerate: ``python -m engine.rpc.regen``).

Import the stubs as ``from engine.rpc import generation_pb2, generation_pb2_grpc``.
"""
