"""GetTokenizer: the model's tokenizer as a ZIP the gateway builds its own from.

``save_pretrained`` of the loaded tokenizer works for every model source (a HF
directory, a GGUF converted to our cache, ``--tokenizer DIR``), chat template included;
the model's config.json and generation_config.json go with it when its directory has
them. Built once, in a worker thread (file I/O and deflate take a good fraction of a
second), from a copy of the tokenizer the engine thread makes (the engine keeps
decoding with its own meanwhile); callers arriving during the build share it.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import io
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from smg_grpc_proto.generated import common_pb2 as cpb

CHUNK_BYTES = 64 * 1024  # per GetTokenizerChunk
MODEL_FILES = ("config.json", "generation_config.json")


class TokenizerBundle:
    """The archive of one engine's tokenizer, built on first use and kept."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._archive: tuple[bytes, str] | None = None
        self._build: asyncio.Task | None = None

    async def archive(self) -> tuple[bytes, str]:
        """(ZIP bytes, their SHA-256 hex digest)."""
        if self._archive is not None:
            return self._archive
        if self._build is None:
            self._build = asyncio.create_task(self._build_once())
        # shield: a caller that goes away does not cancel the build for the others.
        return await asyncio.shield(self._build)

    async def _build_once(self) -> tuple[bytes, str]:
        try:
            tokenizer = await self._engine.call(lambda engine: copy.deepcopy(engine.tokenizer))
            model_dir = self._engine.model_info.get("model_dir") or None
            self._archive = await asyncio.to_thread(build_archive, tokenizer, model_dir)
            return self._archive
        finally:
            self._build = None  # a failed build is tried again by the next caller


def build_archive(tokenizer: Any, model_dir: str | None) -> tuple[bytes, str]:
    with tempfile.TemporaryDirectory(prefix="specserve-tokenizer-") as tmp:
        out = Path(tmp)
        tokenizer.save_pretrained(str(out))
        for name in MODEL_FILES:
            source = Path(model_dir) / name if model_dir else None
            if source is not None and source.is_file() and not (out / name).exists():
                shutil.copyfile(source, out / name)
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for path in sorted(out.iterdir()):
                if path.is_file():
                    archive.write(path, path.name)
    data = buffer.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def chunks(data: bytes, sha256: str) -> Iterator[cpb.GetTokenizerChunk]:
    """At most CHUNK_BYTES each, in order; the digest rides on the last one only."""
    for start in range(0, len(data), CHUNK_BYTES):
        end = min(start + CHUNK_BYTES, len(data))
        yield cpb.GetTokenizerChunk(data=data[start:end], sha256=sha256 if end == len(data) else "")
