"""``specserve serve``: run the server until SIGTERM/SIGINT, then drain and exit 0."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.errors import EngineDeadError
from engine.loader import describe_dtype
from engine.server.app import ServerOptions, SpecserveServer
from engine.server.ports import PortInUseError

logger = logging.getLogger("specserve.server")


def serve(
    config: EngineConfig,
    options: ServerOptions,
    setup: Callable[[SpecserveServer], None] | None = None,
) -> int:
    """Blocking entry point; returns the process exit code.

    ``setup`` runs once the server object exists and before it starts: the place to
    attach step observers and RPC hooks (metrics, request logs).
    """
    return asyncio.run(_serve(config, options, setup))


async def _serve(
    config: EngineConfig,
    options: ServerOptions,
    setup: Callable[[SpecserveServer], None] | None,
) -> int:
    server = SpecserveServer(AsyncEngine(config, freeze_heap=True), options)
    if setup is not None:
        setup(server)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        port = await server.start()
    except PortInUseError as exc:
        raise PortInUseError(exc.port, "--port") from None
    ready = asyncio.create_task(server.wait_ready())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
    exit_code = 0
    if ready.done():
        try:
            ready.result()
            info = server.engine.model_info
            logger.info(
                "serving %s on %s:%d (%s, %s, weights: %s, attention: %s, speculation: %s)",
                info.get("model") or config.model,
                options.host,
                port,
                info.get("device"),
                describe_dtype(config.dtype, info.get("dtype"), info.get("device"))
                + (
                    f", KV cache {info.get('kv_cache_dtype')}"
                    if info.get("kv_cache_dtype") not in (None, info.get("dtype"))
                    else ""
                ),
                describe_quantization(info.get("quantization")),
                info.get("attn_backend"),
                describe_speculation(info),
            )
        except (EngineDeadError, TimeoutError) as exc:
            logger.error("model failed to load: %s", exc)
            exit_code = 1
            stop.set()
    await stopping
    ready.cancel()
    logger.info("shutting down: draining for up to %.0fs", options.shutdown_grace_s)
    await server.shutdown()
    logger.info("stopped")
    return exit_code


def describe_quantization(quantization: str | None) -> str:
    """The weights' form for the startup line."""
    return {
        "gguf": "the .gguf's quantized tensors as stored",
        "int8": "int8, quantized at load",
    }.get(quantization or "none", "float")


def describe_speculation(info: dict) -> str:
    """ "ngram", "none", or the method with its draft ("hybrid, draft .../drafts/x")."""
    method = info.get("speculative_method") or "none"
    draft = info.get("draft_model")
    return f"{method}, draft {draft}" if draft else method
