"""One-time conversion of a .gguf file into a cached Hugging Face directory.

The config, generation config and tokenizer come from the file's metadata through
transformers (~10 s). Served as stored (``--quantization auto``) the weights stay in the
.gguf; dequantized (``--quantization none``, ~20 s, undoing llama.cpp's rotary
permutation of the Q/K weights) they are written as fp32 safetensors beside them. Both
are done once per file: the cache is keyed by the file's path, size and modification
time (seconds), and later loads read that directory like any HF checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import sys
import tempfile
from pathlib import Path

from engine import envs
from engine.default_model import ModelLoadError
from engine.model_config import architectures_of
from engine.models.registry import get_model_class


def converted_dir(gguf_path: Path) -> Path:
    """Cache directory for ``gguf_path``; a changed file (size or mtime) gets a new one.
    The mtime counts in whole seconds: image layers keep no more (a cache converted in
    one build stage and copied into another must still be found)."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{stat.st_size}|{int(stat.st_mtime)}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return envs.cache_dir() / "gguf" / f"{gguf_path.stem}-{digest}"


def ensure_converted(gguf_path: Path, weights: bool = True) -> Path:
    """The converted HF directory for ``gguf_path``, converting on first use: config and
    tokenizer always, the dequantized weights when ``weights``. An architecture we
    cannot serve is refused before any conversion work."""
    target = converted_dir(gguf_path)
    # A read-only cache (a container's baked one) converts into the temp dir instead.
    spare = Path(tempfile.gettempdir()) / "specserve" / "gguf" / target.name
    for found in (target, spare):
        if (found / "config.json").exists() and (
            not weights or (found / "model.safetensors").exists()
        ):
            return found
    check_architecture(gguf_path)
    what = "to safetensors (once, ~20 s)" if weights else "metadata (once, ~10 s)"
    if not _writable(target.parent):
        print(
            f"specserve: the cache {envs.cache_dir()} is read-only; converting into "
            f"{spare.parent} (SPECSERVE_CACHE_DIR names a writable cache that keeps it)",
            file=sys.stderr,
        )
        target = spare
    print(f"specserve: converting {gguf_path.name} {what} ...", file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".converting-") as tmp:
        try:
            _convert(gguf_path, Path(tmp), weights)
        except Exception as exc:  # noqa: BLE001 - a bad file becomes one line for the user
            raise ModelLoadError(f"cannot read {gguf_path}: {type(exc).__name__}: {exc}") from None
        # Publish atomically: a crash mid-conversion never leaves a half-written cache.
        # Readable by every user (mkdtemp makes 0700, safetensors writes 0600): a
        # container image converts as root at build time and serves as uid 10001.
        for path in Path(tmp).iterdir():
            path.chmod(0o644)
        Path(tmp).chmod(0o755)
        shutil.rmtree(target, ignore_errors=True)
        Path(tmp).rename(target)
        Path(tmp).mkdir()  # TemporaryDirectory wants something to remove
    return target


def _writable(directory: Path) -> bool:
    """Whether ``directory`` (or the nearest parent that exists) can be written."""
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    return os.access(directory, os.W_OK | os.X_OK)


def check_architecture(gguf_path: Path) -> None:
    """The one-line "unsupported model architecture" ValueError unless the file's
    ``general.architecture`` is one we serve; reads only the metadata."""
    arch = gguf_architecture(gguf_path)
    architectures = architectures_of({"model_type": arch})
    get_model_class(architectures or (f"{arch!r} (GGUF general.architecture)",))


def gguf_architecture(gguf_path: Path) -> str:
    """``general.architecture`` from the file's header (no tensor data is read)."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(gguf_path)).get_field("general.architecture")
        if field is None:
            raise ValueError("no general.architecture in its metadata")
        return bytes(field.parts[field.data[0]]).decode()
    except Exception as exc:  # noqa: BLE001 - a bad file becomes one line for the user
        raise ModelLoadError(f"cannot read {gguf_path}: {type(exc).__name__}: {exc}") from None


def _convert(gguf_path: Path, out_dir: Path, weights: bool) -> None:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    transformers.utils.logging.set_verbosity_error()
    src_dir, name = str(gguf_path.parent), gguf_path.name
    # transformers draws its own dequantization progress bar; our one line is enough.
    with contextlib.redirect_stderr(io.StringIO()):
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        if weights:
            model = AutoModelForCausalLM.from_pretrained(
                src_dir, gguf_file=name, dtype=torch.float32
            )
            config, generation_config = model.config, model.generation_config
        else:
            config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
            generation_config = GenerationConfig.from_model_config(config)
    # GGUF-derived configs leave the architecture empty
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if weights:
        # save_pretrained refuses GGUF-quantized models; the weights are plain fp32 by
        # now, so write them ourselves.
        from safetensors.torch import save_file

        state = model.state_dict()
        if config.tie_word_embeddings:  # shared with embed_tokens; safetensors refuses aliases
            state.pop("lm_head.weight", None)
        save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"))
    config.save_pretrained(out_dir)
    generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
