"""Shared fixtures: tiny random HF checkpoints built once per session.

    def test_x(tiny_model_dir): ...                     # GQA Llama, 2 layers, untied
    def test_y(tiny_model_factory):
        path = tiny_model_factory(arch="qwen2", tie_word_embeddings=True)

The factory caches by arguments, so equal requests share one directory.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from engine.kernels import build as _build
from tests.tiny_models import (
    make_exact_eagle_draft,
    make_tiny_model,
    make_truncated_draft,
    write_tiny_gguf,
)

_REAL_COMPILE = _build._compile  # the compiler, before any test replaces it

# One thread: tiny models gain nothing from more, and tests that start a server process
# would otherwise have two processes spinning OpenMP threads on a 2-core machine.
torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", default=False,
                     help="run the soak tests (marker 'soak'; minutes, not seconds)")  # fmt: skip
    parser.addoption("--stress-seeds", type=int, default=10,
                     help="seeds of the randomized engine stress test (default 10)")  # fmt: skip


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    built: dict[tuple, str] = {}

    def factory(arch: str = "llama", **overrides) -> str:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in built:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[key] = make_tiny_model(path, arch=arch, **overrides)
        return built[key]

    return factory


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory) -> str:
    """A GQA Llama (4 heads, 2 KV heads, head_dim 16, 2 layers, vocab 259), untied."""
    return tiny_model_factory()


@pytest.fixture(scope="session")
def tiny_bf16_checkpoint(tiny_model_factory) -> str:
    """tiny_model_dir saved in bf16 (its weights rounded), as most checkpoints are
    published: served in float32, its Linear weights are kept as bf16 (issue 35)."""
    return tiny_model_factory(checkpoint_dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def tiny_gguf_factory(tiny_model_factory, tmp_path_factory):
    """A tiny model as a .gguf, its Linear weights and embedding in the given GGUF types
    (``factory(linear="Q4_1", embedding="Q8_0", **model_overrides)``); cached."""
    built: dict[tuple, str] = {}

    def factory(linear: str = "Q4_1", embedding: str = "Q8_0", **overrides) -> str:
        key = (linear, embedding, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in built:
            hf_dir = tiny_model_factory(**overrides)
            path = tmp_path_factory.mktemp("tiny-gguf") / f"tiny-{linear}-{embedding}.gguf"
            built[key] = write_tiny_gguf(hf_dir, path, linear, embedding)
        return built[key]

    return factory


@pytest.fixture(scope="session")
def tiny_gguf_path(tiny_gguf_factory) -> str:
    """tiny_model_dir as the default model ships: Q4_1 Linear weights (the untied head
    too), a Q8_0 embedding, F32 norms; served as stored by default."""
    return tiny_gguf_factory()


@pytest.fixture(scope="session")
def tiny_draft_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """A draft for tiny_model_dir: the target cut down to its first layer. Same
    tokenizer, correlated predictions, so some drafts are accepted and some are not."""
    return make_truncated_draft(tiny_model_dir, tmp_path_factory.mktemp("tiny-draft"))


@pytest.fixture(scope="session")
def spec_draft_dirs(
    tiny_draft_model_dir, tiny_trained_draft_dir, tiny_eagle_draft_dir
) -> dict[str, str]:
    """The draft each speculative method runs with in the lossless tests: "draft" the
    truncated target, "hybrid" (n-gram where the context repeats) the trained draft,
    "eagle" the EAGLE draft (SPEC_CONFIGS rows may name it for hybrid too)."""
    return {
        "draft": tiny_draft_model_dir,
        "hybrid": tiny_trained_draft_dir,
        "eagle": tiny_eagle_draft_dir,
    }


@pytest.fixture(scope="session")
def tiny_trained_draft_dir(tiny_model_dir, tmp_path_factory) -> str:
    """A draft for tiny_model_dir made by `specserve train-draft` itself (a few seconds):
    two layers, the target's embedding and head rows, trained on its own answers."""
    from engine.entrypoints.cli import main

    out = tmp_path_factory.mktemp("tiny-trained-draft")
    argv = ["train-draft", "--model", tiny_model_dir, "--out", str(out), "--num-prompts", "48"]
    argv += ["--max-tokens", "48", "--epochs", "3", "--tokens-per-batch", "1024"]
    argv += ["--train-dtype", "float32", "--draft-vocab", "200"]
    if main(argv) != 0:
        raise RuntimeError("train-draft failed for the tiny model")
    return str(out)


@pytest.fixture(scope="session")
def tiny_eagle_draft_dir(tiny_model_dir, tmp_path_factory) -> str:
    """An EAGLE draft for tiny_model_dir made by `specserve train-draft --method eagle`
    (a few seconds): one layer reading the target's layers 0 and 1 (its default aux
    layers), trained with training-time test on the target's own answers."""
    from engine.entrypoints.cli import main

    out = tmp_path_factory.mktemp("tiny-eagle-draft")
    argv = ["train-draft", "--method", "eagle", "--model", tiny_model_dir, "--out", str(out)]
    argv += ["--num-prompts", "48", "--max-tokens", "48", "--epochs", "3"]
    argv += ["--tokens-per-batch", "1024", "--train-dtype", "float32", "--draft-vocab", "200"]
    argv += ["--lr", "0.01"]  # 21 steps, all in warmup: a higher peak gets drafts accepted
    if main(argv) != 0:
        raise RuntimeError("train-draft --method eagle failed for the tiny model")
    return str(out)


@pytest.fixture(scope="session")
def close_eagle_targets(tiny_model_factory, tiny_gguf_factory, tmp_path_factory) -> dict:
    """{"float": (target, draft), "gguf": (target, draft)}: a one-layer target with
    unit-RMS embeddings (as a float model, and as a .gguf served quantized) and an EAGLE
    draft that computes what the float target computes, its layer's weights jittered by
    15%: most drafts accepted, many rejected (trained tiny drafts are rarely accepted on
    the tests' prompts, which would leave the accept paths untested)."""
    # seed 1: no near-tie at the top-2 boundary in bf16, where transformers (the
    # statistical tests' reference) and the kernels round differently
    overrides = dict(num_hidden_layers=1, unit_rms_embeddings=True, seed=1)
    float_dir = tiny_model_factory(**overrides)
    gguf_path = tiny_gguf_factory(**overrides)
    return {
        kind: (target, make_exact_eagle_draft(
            float_dir, tmp_path_factory.mktemp(f"close-eagle-{kind}"), 0.15, served_as=target
        ))
        for kind, target in (("float", float_dir), ("gguf", gguf_path))
    }  # fmt: skip


@pytest.fixture(scope="session")
def prebuilt_kernel_dir(tmp_path_factory) -> tuple:
    """(directory, files): ``prebuild``'s library of every prebuilt level of this
    architecture, best first (once a session: each level is a compile of 10-20 s,
    one per CPU at a time). Read-only for the tests: copy it to write beside it."""
    import platform

    from engine.kernels import build as build_mod

    if platform.machine() not in build_mod.PREBUILT_LEVELS:
        pytest.skip(f"no prebuilt kernel levels for {platform.machine()}")
    out = tmp_path_factory.mktemp("kernel-levels") / "kernels"
    return out, build_mod.prebuild(out)


@pytest.fixture(scope="session")
def native_kernel_build() -> Path:
    """The -march=native library of this source, as ``cpu_kernels()`` builds it in the
    kernel cache (compiled there once, then reused)."""
    from engine.kernels import build as build_mod

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SPECSERVE_KERNEL_LEVEL", raising=False)
        return build_mod.build_library()


@pytest.fixture()
def compile_once(request, native_kernel_build, monkeypatch) -> None:
    """Builds of this source reuse the session's compiles instead of compiling again: 10-20
    s of gcc at -O3 each on a 2-core machine, and the tests of where builds go and which
    file is loaded make dozens. ``build._compile`` writes the bytes of the session's
    build for the same -march (the native one above, or the prebuilt level's) into the
    build directory, as the compiler would (another source or compiler still compiles);
    everything around it (the cache rules, names, modes, atomic renames, loading) runs
    as in production. The compile
    itself runs for real in those session builds and for any other source."""
    from engine.kernels import build as build_mod

    real, source, compiler = build_mod._compile, build_mod.read_source(), build_mod._compiler()

    def compile_(cc, src, build_dir, name, march="native"):
        if src != source or cc != compiler:
            return real(cc, src, build_dir, name, march)
        if march == "native":
            built = native_kernel_build
        else:
            built = request.getfixturevalue("prebuilt_kernel_levels")[march]
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=build_dir[1])
        with os.fdopen(fd, "wb") as out, open(built, "rb") as f:
            shutil.copyfileobj(f, out)

    monkeypatch.setattr(build_mod, "_compile", compile_)


@pytest.fixture()
def on_amx_tiles(request, monkeypatch):
    """Kernels whose AMX paths run (this CPU's tiles, else the emulated AMX level:
    tests/engine/kernel_levels.py), made the process's for the test, so the models it
    loads run on them; the test skips where neither exists (no AMX, and no AVX512-BF16
    to emulate it on)."""
    from tests.engine.kernel_levels import amx_kernels, use_kernels

    found = amx_kernels(request)
    if found is None:
        pytest.skip("no AMX tiles here, nor AVX512-BF16 to emulate them on")
    use_kernels(monkeypatch, found)
    before = found.decoder_team
    yield found
    found.set_decoder_team(before)


@pytest.fixture(scope="session")
def prebuilt_kernel_levels(prebuilt_kernel_dir) -> dict:
    """level -> the compiled library of every prebuilt level of this architecture, and
    of the emulated AMX level where this CPU runs it."""
    import platform

    from engine.kernels import build as build_mod

    levels = [level for level, _ in build_mod.PREBUILT_LEVELS[platform.machine()]]
    built = dict(zip(levels, prebuilt_kernel_dir[1], strict=True))
    if build_mod.emulated_amx_runnable():  # the test build with AMX emulated (kernel_levels.py)
        emulated = build_mod.EMULATED_AMX_LEVEL
        # compiled for real even when this fixture is first asked for from inside
        # compile_once's stand-in compiler, which would ask for this fixture again
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(build_mod, "_compile", _REAL_COMPILE)
            built[emulated] = build_mod.build_source(build_mod.read_source(), emulated)
    return built
