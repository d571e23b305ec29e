"""specserve engine: everything that touches tensors or the outside world.

Public: ``from engine import LLM, SamplingParams`` (the offline API) and
``engine.client.SpecserveClient`` (the gRPC client). docs/architecture.md maps the folders."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.io.outputs import RequestOutput
from engine.io.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.entrypoints.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams", "version"]


def version() -> str:
    """The installed package's version; "unknown (...)" for a source tree never installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("specserve")
    except PackageNotFoundError:
        return "unknown (not installed; run scripts/install.sh)"


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from engine.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
