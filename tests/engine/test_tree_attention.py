"""Token-tree attention: a node's row sees the context, the verified tokens fed before
the tree, and its own ancestors and itself, nothing else of the step, and equals the
row of plain decoding along its path.

Kernel level, at every prebuilt ISA level this CPU runs (fp32, bf16, the vdpbf16ps rows
where the level has them): each tree row is bit for bit the row of a sequence whose
cache holds the node's path as a plain chain. Model level (the tiny Llama through the
loader; the cpu backend in fp32 and bf16, the fused one-call decoder, the torch
backend): each node's logits against feeding its path as a chain, and the accepted path
moved into place by ``ModelRunner.move_kv``.
"""

from __future__ import annotations

import platform
import random

import pytest
import torch

from engine.attention.metadata import as_mask_tensor
from engine.core.model_runner import ModelRunner, SeqInput
from engine.kernels import build as build_mod
from engine.kernels.cpu import CpuKernels, cpu_kernels
from engine.loader import load_model
from engine.spec_decode import paths

BLOCK = 16

# (parents, verified tokens fed before the tree): a chain, a star, deep and branching
TREES = {
    "chain": ([-1, 0, 1, 2], 1),
    "star": ([-1] * 9, 1),
    "deep-branching": ([-1, 0, 0, 1, 3, 3, -1, 6, 4, 8, 2, 10, 11], 1),
    "after-3-verified": ([-1, 0, -1, 2, 2, 4, 5, 6, 1], 3),
    "wide-past-a-block": ([-1, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 7, 8, 9, 10, 11, 12, 13, 14], 1),
}


def _levels() -> list[str]:
    have = build_mod.cpu_flags()
    levels = build_mod.PREBUILT_LEVELS.get(platform.machine(), [])
    return ["native"] + [level for level, needs in levels if needs <= have]


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernel-levels")
    levels = [level for level, _ in build_mod.PREBUILT_LEVELS[platform.machine()]]
    return dict(zip(levels, build_mod.prebuild(out), strict=True))


@pytest.fixture(scope="module", params=_levels())
def kernels(request) -> CpuKernels:
    if request.param == "native":
        return cpu_kernels()
    return CpuKernels(request.getfixturevalue("prebuilt")[request.param])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 24])  # 64: the bf16 vdpbf16ps rows; 24: the generic
@pytest.mark.parametrize("context", [5, 16, 37])
@pytest.mark.parametrize("tree", list(TREES))
def test_each_tree_row_is_its_paths_plain_row_bit_for_bit(kernels, tree, context, head_dim,
                                                          dtype):  # fmt: skip
    parents, m = TREES[tree]
    heads, kv_heads = 6, 2
    gen = torch.Generator().manual_seed(len(parents) * 100 + context)
    n_nodes = len(parents)
    q_len = m + n_nodes
    num_blocks = 64
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    step_start = context  # keys before the step: the context
    seq_len = step_start + q_len
    free = list(range(1, num_blocks))
    random.Random(context).shuffle(free)
    table = [free.pop() for _ in range(-(-seq_len // BLOCK))]
    q = torch.randn(q_len, heads, head_dim, generator=gen).to(dtype)
    masks = paths.ancestor_masks(parents, m, n_nodes)
    out = torch.full_like(q, float("nan"))
    kernels.paged_attention(
        out, q, k_cache, v_cache, torch.tensor([table], dtype=torch.int32),
        torch.tensor([seq_len], dtype=torch.int32), torch.tensor([0, q_len], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32), q_len, head_dim**-0.5,
        as_mask_tensor(masks, "cpu"),
    )  # fmt: skip
    # Each row again as the last query of a plain sequence holding what the row sees,
    # in order, in blocks of its own.
    for j in range(q_len):
        fed = [b for b in range(j + 1) if masks[j] >> b & 1]
        keys = list(range(step_start)) + [step_start + b for b in fed]
        plain_table = [free.pop() for _ in range(-(-len(keys) // BLOCK))]
        for v, key in enumerate(keys):
            src_block, src_off = table[key // BLOCK], key % BLOCK
            dst_block, dst_off = plain_table[v // BLOCK], v % BLOCK
            k_cache[dst_block, dst_off] = k_cache[src_block, src_off]
            v_cache[dst_block, dst_off] = v_cache[src_block, src_off]
        plain = torch.full_like(q[j : j + 1], float("nan"))
        kernels.paged_attention(
            plain, q[j : j + 1], k_cache, v_cache, torch.tensor([plain_table], dtype=torch.int32),
            torch.tensor([len(keys)], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32), 1, head_dim**-0.5,
        )  # fmt: skip
        free.extend(plain_table)
        assert _same_bits(out[j : j + 1], plain), (tree, j)


def test_all_ones_masks_are_plain_causal_attention(kernels):
    gen = torch.Generator().manual_seed(3)
    q_lens, seq_lens = [5, 1, 33], [40, 9, 60]
    tables = [[1, 2, 3], [4], [5, 6, 7, 8]]
    k_cache = torch.randn(12, BLOCK, 2, 64, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(12, BLOCK, 2, 64, generator=gen).to(torch.bfloat16)
    q = torch.randn(sum(q_lens), 4, 64, generator=gen).to(torch.bfloat16)
    args = (
        k_cache, v_cache,
        torch.tensor([t + [0] * (4 - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32), torch.tensor([0, 5, 6, 39], dtype=torch.int32),
        torch.tensor([0, 1, 2], dtype=torch.int32), max(q_lens), 0.125,
    )  # fmt: skip
    plain, masked = torch.empty_like(q), torch.empty_like(q)
    kernels.paged_attention(plain, q, *args)
    kernels.paged_attention(masked, q, *args, torch.full((39,), -1, dtype=torch.int64))
    assert _same_bits(plain, masked)


def test_tree_masks_must_be_one_int64_per_token():
    kernels = cpu_kernels()
    q = torch.zeros(3, 2, 16)
    cache = torch.zeros(4, BLOCK, 1, 16)
    with pytest.raises(ValueError, match="tree_masks must be a dense"):
        kernels.paged_attention(
            torch.empty_like(q), q, cache, cache, torch.tensor([[1]], dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32), 3, 0.25, torch.zeros(2, dtype=torch.int64),
        )  # fmt: skip


# ---- the model -----------------------------------------------------------------------

MODEL_CASES = {
    "cpu-fp32": dict(dtype="float32", attn_backend="cpu"),
    "cpu-bf16-fused": dict(dtype="bfloat16", attn_backend="cpu"),
    "cpu-bf16-layers": dict(dtype="bfloat16", attn_backend="cpu", fused=False),
    "torch-fp32": dict(dtype="float32", attn_backend="torch"),
}


def _runner(model_dir: str, dtype: str, attn_backend: str, fused: bool = True) -> ModelRunner:
    loaded = load_model(model_dir, dtype=dtype, device="cpu", attn_backend=attn_backend)
    runner = ModelRunner(loaded, num_blocks=160, block_size=BLOCK)
    if not fused:
        runner.model.model.fused = None
    return runner


class _Blocks:
    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_tree_logits_equal_the_logits_of_each_path(tiny_model_dir, case):
    options = dict(MODEL_CASES[case])
    runner = _runner(tiny_model_dir, **options)
    rng = random.Random(1)
    prompt = [rng.randrange(3, 250) for _ in range(21)]
    blocks = _Blocks()
    for name in ("deep-branching", "after-3-verified", "wide-past-a-block"):
        parents, m = TREES[name]
        nodes = [rng.randrange(3, 250) for _ in parents]
        context, verified = prompt[:-m], prompt[-m:]
        table = blocks.take(6)
        runner.forward([SeqInput(context, 0, table, 1)])
        # beside the tree, another sequence decodes one token in the same step
        other_table = blocks.take(3)
        other = [rng.randrange(3, 250) for _ in range(30)]
        runner.forward([SeqInput(other[:-1], 0, other_table, 1)])
        root = len(context) + m - 1
        depth = paths.depths(parents, len(parents))
        tree = SeqInput(
            verified + nodes, len(context), table, m + len(parents),
            positions=[*range(len(context), root + 1), *(root + d for d in depth)],
            tree_mask=paths.ancestor_masks(parents, m, len(parents)),
        )  # fmt: skip
        logits = runner.forward([SeqInput([other[-1]], 29, other_table, 1), tree])
        tree_logits = logits[1:]
        chain_table = blocks.take(6)  # each path prefilled again into these
        for i in range(len(parents)):
            path = [nodes[k] for k in paths.node_path(parents, i)]
            runner.forward([SeqInput(context, 0, chain_table, 1)])
            chain = runner.forward(
                [SeqInput(verified + path, len(context), chain_table, m + len(path))]
            )
            want, got = chain[-1], tree_logits[m + i]
            if options["dtype"] == "bfloat16" and options["attn_backend"] == "cpu":
                assert torch.equal(got, want), (case, name, i)
            else:
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(tree_logits[:m], chain[:m], rtol=1e-4, atol=1e-4)


def test_move_kv_moves_every_layer_and_reads_before_writing(tiny_model_dir):
    runner = _runner(tiny_model_dir, "float32", "cpu")
    pool = runner._pool
    gen = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    before = [c.clone() for c in runner.kv_caches]
    # overlapping: slot 33 is both a destination and a source
    src, dst = [35, 33, 40], [33, 34, 36]
    runner.move_kv(src, dst)
    for layer, (cache, old) in enumerate(zip(runner.kv_caches, before)):
        flat_new = cache.view(2, -1, *cache.shape[3:])
        flat_old = old.view(2, -1, *old.shape[3:])
        for s, d in zip(src, dst):
            assert torch.equal(flat_new[:, d], flat_old[:, s]), (layer, s, d)
        untouched = [i for i in range(flat_old.shape[1]) if i not in dst]
        assert torch.equal(flat_new[:, untouched], flat_old[:, untouched])
    assert pool.shape[0] == len(runner.kv_caches)
