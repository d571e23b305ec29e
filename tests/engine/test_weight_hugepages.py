"""A CPU model's large weights are moved at load into one allocation advised onto 2 MB
pages (``weights_on_huge_pages``): a decode step streams every weight, and on 4 KB pages
that is a TLB miss every 4 KB. The move changes no bit of the model's outputs, keeps a
tied head and embedding one tensor, leaves small tensors (norms, biases) where they
are, and ``SPECSERVE_WEIGHT_HUGEPAGES=0`` leaves everything where loading put it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from engine.loader import load_model
from engine.models.quant import QuantizedEmbedding, QuantizedLinear
from engine.models.weights import _HUGE_PAGE_MIN_BYTES as MIN_BYTES
from tests.engine.simple_runner import SimplePagedRunner
from tests.engine.test_kv_hugepages import THP

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are not available on this host",
)

# wide enough that every Linear and the embedding pass the 64 KB floor in either dtype
WIDE = {"hidden_size": 128, "intermediate_size": 1024, "vocab_size": 1100}


def _large(model) -> dict[str, torch.Tensor]:
    """The weights the move is for: each Linear's (packed or quantized) and the
    embedding's."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            out[name] = module.weight_q.data
        elif isinstance(getattr(module, "packed_weight", None), torch.Tensor):
            out[name] = module.packed_weight
        elif isinstance(module, torch.nn.Embedding):
            out[name] = module.weight.data
    return out


def _mapping(address: int) -> tuple[int, int, set[str]]:
    """(start, end, VmFlags) of the mapping that holds ``address``."""
    span = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            span = (int(m.group(1), 16), int(m.group(2), 16))
            span = span if span[0] <= address < span[1] else None
        elif span and line.startswith("VmFlags:"):
            return span[0], span[1], set(line.split(":", 1)[1].split())
    raise AssertionError(f"no mapping holds {address:#x}")


def _load_and_run(path: str, dtype: str, setting: str, monkeypatch):
    monkeypatch.setenv("SPECSERVE_WEIGHT_HUGEPAGES", setting)
    loaded = load_model(path, dtype=dtype, device="cpu")
    runner = SimplePagedRunner(loaded.model, num_blocks=16)
    runner.add_sequence(0)
    runner.add_sequence(1)
    logits = [runner.step([(0, [5, 9, 33, 7, 2]), (1, [40, 41])], all_logits=True)]
    logits.append(runner.step([(0, [8]), (1, [3])]))  # a decode step, on the one-call path
    return loaded.model, logits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["float", "gguf", "tied"])
def test_large_weights_move_onto_advised_pages_and_compute_the_same(
    kind, dtype, tiny_model_factory, tiny_gguf_factory, monkeypatch
):
    path = {
        "float": lambda: tiny_model_factory(**WIDE),
        "gguf": lambda: tiny_gguf_factory(**WIDE),
        "tied": lambda: tiny_gguf_factory(tie_word_embeddings=True, **WIDE),
    }[kind]()
    import engine.loader

    calls = []
    real = engine.loader.weights_on_huge_pages
    monkeypatch.setattr(
        engine.loader, "weights_on_huge_pages", lambda m: calls.append(m) or real(m)
    )
    moved, moved_logits = _load_and_run(path, dtype, "1", monkeypatch)
    kept, kept_logits = _load_and_run(path, dtype, "0", monkeypatch)
    assert calls == [moved]  # not with the setting off
    for got, want in zip(moved_logits, kept_logits, strict=True):
        assert torch.equal(got, want)
    weights = _large(moved)
    assert len(weights) == 2 * 4 + 2  # qkv, o, gate_up, down of two layers; embedding, head
    large = {n for n, t in weights.items() if t.numel() * t.element_size() >= MIN_BYTES}
    assert len(large) >= 6  # gate_up and down of each layer, the embedding and the head
    # the large ones in one advised mapping of their own; the others (and the norms),
    # where loading put them, outside it
    start, end, flags = _mapping(weights[min(large)].data_ptr())
    assert "hg" in flags
    for name, t in weights.items():
        inside = start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= end
        assert inside == (name in large), name
    assert not start <= moved.model.norm.weight.data_ptr() < end
    if kind == "tied":  # the quantized head is still the embedding's weight, moved once
        assert moved.lm_head.weight_q is moved.model.embed_tokens.weight_q
