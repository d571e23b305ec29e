"""One-time conversion of a .gguf file into a cached Hugging Face directory.

Dequantizing through transformers takes ~20 s (it also undoes llama.cpp's rotary
permutation of the Q/K weights), so we do it once per file and keep fp32 safetensors,
config, generation config and tokenizer in the cache, keyed by the file's path, size
and modification time (seconds). Later loads read that directory like any HF checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
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


def ensure_converted(gguf_path: Path) -> Path:
    """The converted HF directory for ``gguf_path``, converting on first use. An
    architecture we cannot serve is refused before any conversion work."""
    target = converted_dir(gguf_path)
    if (target / "config.json").exists():
        return target
    check_architecture(gguf_path)
    print(
        f"specserve: converting {gguf_path.name} to safetensors (once, ~20 s) ...",
        file=sys.stderr,
        flush=True,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".converting-") as tmp:
        try:
            _convert(gguf_path, Path(tmp))
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


def _convert(gguf_path: Path, out_dir: Path) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.set_verbosity_error()
    src_dir, name = str(gguf_path.parent), gguf_path.name
    # transformers draws its own dequantization progress bar; our one line is enough.
    with contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    # save_pretrained refuses GGUF-quantized models; the weights are plain fp32 by now, so
    # write them ourselves and drop the quantization marker from the config.
    config = model.config
    config.architectures = [type(model).__name__]  # GGUF-derived configs leave it empty
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shared with embed_tokens; safetensors refuses aliases
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"))
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
