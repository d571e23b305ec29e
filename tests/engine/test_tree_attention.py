"""Token-tree attention: a node's row sees the context, the verified tokens fed before
the tree, and its own ancestors and itself, nothing else of the step, and equals the
row of plain decoding along its path.

Kernel level, at every prebuilt ISA level this CPU runs (fp32, bf16, the vdpbf16ps rows
where the level has them): each tree row is bit for bit the row of a sequence whose
cache holds the node's path as a plain chain; random masks over 80 fed tokens (past
bit 63 and past a query tile) match a float64 reference; a non-finite key or value
reaches only the rows that see it; masks of -1 are no masks. Model level (the tiny
Llama through the loader; the cpu backend in fp32 and bf16, its SDPA part, the fused
one-call decoder, the torch backend in fp32 and bf16, every kernel level): each node's
logits against feeding its path as a chain, beside a decode or a plain chain; masks
of -1 change no bit; a tree of more than 64 fed tokens; the accepted path moved into
place by ``ModelRunner.move_kv``.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import cpu_backend
from engine.attention.metadata import as_mask_tensor
from engine.core.model_runner import ModelRunner, SeqInput
from engine.kernels.cpu import CpuKernels, cpu_kernels
from engine.loader import load_model
from engine.spec_decode import paths
from tests.engine.kernel_levels import kernels_at_level, runnable_levels, use_kernels

BLOCK = 16

# (parents, verified tokens fed before the tree): a chain, a star, deep and branching
TREES = {
    "chain": ([-1, 0, 1, 2], 1),
    "star": ([-1] * 9, 1),
    "deep-branching": ([-1, 0, 0, 1, 3, 3, -1, 6, 4, 8, 2, 10, 11], 1),
    "after-3-verified": ([-1, 0, -1, 2, 2, 4, 5, 6, 1], 3),
    "wide-past-a-block": ([-1, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 7, 8, 9, 10, 11, 12, 13, 14], 1),
}


@pytest.fixture(scope="module", params=runnable_levels())
def kernels(request) -> CpuKernels:
    return kernels_at_level(request)


# (rows' dtype, KV cache's dtype): fp32 rows over a bf16 cache is --kv-cache-dtype bfloat16
KV_DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
]
KV_IDS = ["fp32", "bf16", "fp32-bf16kv"]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


@pytest.mark.parametrize("dtype,kv_dtype", KV_DTYPES, ids=KV_IDS)
@pytest.mark.parametrize("head_dim", [64, 24])  # 64: the bf16 vdpbf16ps rows; 24: the generic
@pytest.mark.parametrize("context", [5, 16, 37, 150])  # 150: past a key chunk (8 blocks)
@pytest.mark.parametrize("tree", list(TREES))
def test_each_tree_row_is_its_paths_plain_row_bit_for_bit(kernels, tree, context, head_dim,
                                                          dtype, kv_dtype):  # fmt: skip
    parents, m = TREES[tree]
    heads, kv_heads = 6, 2
    gen = torch.Generator().manual_seed(len(parents) * 100 + context)
    n_nodes = len(parents)
    q_len = m + n_nodes
    num_blocks = 64
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=gen).to(kv_dtype)
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


def _masked_reference(q, k_cache, v_cache, tables, seq_lens, q_lens, masks, scale):
    """Float64 attention by the rule the kernels implement: query j of a sequence sees
    every key before the step, and fed token b <= j when b >= 64 or bit b of its mask."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    start = 0
    for table, s_len, q_len in zip(tables, seq_lens, q_lens, strict=True):
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(s_len)])
        keys = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)
        values = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)
        step_start = s_len - q_len
        for j in range(q_len):
            mask = masks[start + j]
            fed = [p - step_start for p in range(step_start + j + 1)]
            seen = [p for p, b in enumerate(fed) if b < 0 or b >= 64 or mask >> b & 1]
            scores = torch.einsum("hd,khd->kh", q[start + j].double(), keys[seen]) * scale
            out[start + j] = torch.einsum("kh,khd->hd", scores.softmax(0), values[seen])
        start += q_len
    return out


def _random_masks(rng: random.Random, q_len: int, density: float) -> list[int]:
    """A mask per fed token that sees itself and a random subset of the earlier ones
    (not necessarily a tree: the kernels' rule is per row)."""
    return [
        (1 << j) | sum(1 << b for b in range(min(j, 64)) if rng.random() < density)
        for j in range(q_len)
    ]


@pytest.mark.parametrize("dtype,kv_dtype", KV_DTYPES, ids=KV_IDS)
@pytest.mark.parametrize("head_dim", [64, 24])
def test_masked_rows_match_a_float64_reference(kernels, head_dim, dtype, kv_dtype):
    # A tree after a long context; 80 fed tokens (rows past Q_TILE = 32 and past bit 63,
    # where fed tokens 64 on are seen causally); plain causal rows beside them; a step
    # with no context before it; a decode; a sequence whose second tile alone has trees.
    rng = random.Random(head_dim)
    q_lens, seq_lens = [19, 80, 7, 1, 40, 12], [60, 90, 7, 33, 45, 12]
    masks: list[int] = []
    masks += _random_masks(rng, 19, 0.5)
    masks += _random_masks(rng, 80, 0.7)
    masks += [-1] * 7
    masks += [-1]
    masks += [-1] * 33 + _random_masks(rng, 40, 0.4)[33:]
    masks += [m | -(1 << 12) for m in _random_masks(rng, 12, 0.3)]  # high bits set, unused
    heads, kv_heads, num_blocks = 6, 2, 40
    gen = torch.Generator().manual_seed(head_dim)
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=gen).to(kv_dtype)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // BLOCK))] for s in seq_lens]
    width = max(len(t) for t in tables)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    out = torch.full_like(q, float("nan"))
    kernels.paged_attention(
        out, q, k_cache, v_cache,
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
        torch.arange(len(q_lens), dtype=torch.int32), max(q_lens), head_dim**-0.5,
        as_mask_tensor(masks, "cpu"),
    )  # fmt: skip
    want = _masked_reference(q, k_cache, v_cache, tables, seq_lens, q_lens, masks, head_dim**-0.5)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype is torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.double(), want, **tol)


# (an infinite key can score -inf, weight 0: its rows may stay finite)
@pytest.mark.parametrize(
    ("where", "value"),
    [("k", float("nan")), ("v", float("nan")), ("v", float("inf"))],
    ids=["k-nan", "v-nan", "v-inf"],
)
@pytest.mark.parametrize("dtype,kv_dtype", KV_DTYPES, ids=KV_IDS)
@pytest.mark.parametrize("head_dim", [64, 24])
def test_a_key_a_row_does_not_see_never_reaches_it(
    kernels, head_dim, dtype, kv_dtype, where, value
):
    """A non-finite K or V of a tree node reaches its own row and its descendants' and
    no other: its siblings' rows are the clean rows bit for bit (a masked key is
    skipped, never weighted 0; 0 * NaN is NaN)."""
    parents, m = [-1, 0, -1, 2, 2, 1, 4], 1  # node 2's subtree: 2, 3, 4, 6
    step_start, q_len = 21, m + len(parents)
    seq_len = step_start + q_len
    table = [5, 2, 7]
    gen = torch.Generator().manual_seed(head_dim)
    cache = {
        "k": torch.randn(8, BLOCK, 2, head_dim, generator=gen).to(kv_dtype),
        "v": torch.randn(8, BLOCK, 2, head_dim, generator=gen).to(kv_dtype),
    }
    q = torch.randn(q_len, 4, head_dim, generator=gen).to(dtype)
    masks = as_mask_tensor(paths.ancestor_masks(parents, m, len(parents)), "cpu")

    def attend(k_cache, v_cache):
        out = torch.full_like(q, float("nan"))
        kernels.paged_attention(
            out, q, k_cache, v_cache, torch.tensor([table], dtype=torch.int32),
            torch.tensor([seq_len], dtype=torch.int32), torch.tensor([0, q_len], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32), q_len, head_dim**-0.5, masks,
        )  # fmt: skip
        return out

    clean = attend(cache["k"], cache["v"])
    bad_token = m + 2  # fed token of node 2
    key = step_start + bad_token
    cache[where] = cache[where].clone()
    cache[where][table[key // BLOCK], key % BLOCK, 1, 3] = value  # KV head 1: heads 2, 3
    out = attend(cache["k"], cache["v"])
    sees_bad = [bool(int(masks[j]) >> bad_token & 1) for j in range(q_len)]
    assert sees_bad == [False, False, False, True, True, True, False, True]
    for j in range(q_len):
        assert _same_bits(out[j, :2], clean[j, :2]), j  # the other KV head's group
        if sees_bad[j]:
            assert not out[j, 2:].isfinite().all(), j
        else:
            assert _same_bits(out[j, 2:], clean[j, 2:]), j


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

# A case: load options, and whether a tree row must equal its path's row bit for bit
# (the bf16 kernels compute a node exactly as decoding its path; elsewhere the GEMMs of
# a tree step and of a chain differ in shape, so their rounding does).
MODEL_CASES = {
    "cpu-fp32": dict(dtype="float32", attn_backend="cpu"),
    # float32's former split: a query of more than one token on SDPA (cpu_backend's
    # long part), the decode beside it on the kernel
    "cpu-fp32-sdpa": dict(dtype="float32", attn_backend="cpu", sdpa_from=2),
    "cpu-bf16-fused": dict(dtype="bfloat16", attn_backend="cpu", exact=True),
    "cpu-bf16-layers": dict(dtype="bfloat16", attn_backend="cpu", fused=False, exact=True),
    # head_dim 32: the vdpbf16ps rows (the tiny model's 16 runs the generic ones)
    "cpu-bf16-fused-hd32": dict(dtype="bfloat16", attn_backend="cpu", exact=True, hd32=True),
    "torch-fp32": dict(dtype="float32", attn_backend="torch"),
    "torch-bf16": dict(dtype="bfloat16", attn_backend="torch"),
}
# the kernel trees, and a chain and a star after 3 verified tokens
MODEL_TREES = {**TREES, "chain-after-3": ([-1, 0, 1, 2, 3], 3), "star-after-3": ([-1] * 6, 3)}
HD32 = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def _runner(model_dir: str, dtype: str, attn_backend: str, fused: bool = True) -> ModelRunner:
    loaded = load_model(model_dir, dtype=dtype, device="cpu", attn_backend=attn_backend)
    runner = ModelRunner(loaded, num_blocks=200, block_size=BLOCK)
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


def _assert_rows(got: torch.Tensor, want: torch.Tensor, dtype: str, exact: bool, where) -> None:
    if exact:
        assert torch.equal(got, want), where
    elif dtype == "float32":
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=str(where))
    else:  # bf16 activations through two layers, rounded where the shapes differ
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05, msg=str(where))


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_tree_logits_equal_the_logits_of_each_path(tiny_model_factory, case, monkeypatch):
    options = dict(MODEL_CASES[case])
    exact, sdpa_from = options.pop("exact", False), options.pop("sdpa_from", None)
    model_dir = tiny_model_factory(**(HD32 if options.pop("hd32", False) else {}))
    if sdpa_from is not None:
        monkeypatch.setattr(
            cpu_backend, "_make_plan", lambda md, dtype: cpu_backend.split_plan(md, sdpa_from - 1)
        )
    runner = _runner(model_dir, **options)
    _check_trees(runner, options["dtype"], exact, case)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tree_logits_at_every_kernel_level(kernels, tiny_model_factory, dtype, monkeypatch):
    """The model on the cpu backend with each prebuilt level's kernels (the fused
    decoder where the level has the bf16 Linear kernel it needs)."""
    use_kernels(monkeypatch, kernels)
    runner = _runner(tiny_model_factory(**HD32), dtype, "cpu")
    assert runner.model.model.layers[0].self_attn.attn_backend.kernels is kernels
    # the bf16 Linear kernel makes a row independent of the batch; oneDNN's GEMMs do not
    exact = dtype == "bfloat16" and kernels.has_bf16_linear
    _check_trees(runner, dtype, exact, dtype)


def _check_trees(runner: ModelRunner, dtype: str, exact: bool, case: str) -> None:
    """Every MODEL_TREES tree verified in one step beside another sequence (a decode, or
    a plain 4-token chain), each node's logits against its path fed as a chain, the
    other sequence's against the same tokens fed alone."""
    rng = random.Random(1)
    prompt = [rng.randrange(3, 250) for _ in range(21)]
    blocks = _Blocks()
    for t, (name, (parents, m)) in enumerate(MODEL_TREES.items()):
        nodes = [rng.randrange(3, 250) for _ in parents]
        context, verified = prompt[:-m], prompt[-m:]
        table = blocks.take(6)
        runner.forward([SeqInput(context, 0, table, 1)])
        other_table = blocks.take(3)
        other = [rng.randrange(3, 250) for _ in range(30)]
        other_fed = 1 if t % 2 == 0 else 4
        runner.forward([SeqInput(other[:-other_fed], 0, other_table, 1)])
        other_step = SeqInput(other[-other_fed:], 30 - other_fed, other_table, other_fed)
        root = len(context) + m - 1
        depth = paths.depths(parents, len(parents))
        tree = SeqInput(
            verified + nodes, len(context), table, m + len(parents),
            positions=[*range(len(context), root + 1), *(root + d for d in depth)],
            tree_mask=paths.ancestor_masks(parents, m, len(parents)),
        )  # fmt: skip
        logits = runner.forward([other_step, tree])
        other_logits, tree_logits = logits[:other_fed], logits[other_fed:]
        _assert_rows(other_logits, runner.forward([other_step]), dtype, exact, (case, name))
        chain_table = blocks.take(6)  # each path prefilled again into these
        for i in range(len(parents)):
            path = [nodes[k] for k in paths.node_path(parents, i)]
            runner.forward([SeqInput(context, 0, chain_table, 1)])
            chain = runner.forward(
                [SeqInput(verified + path, len(context), chain_table, m + len(path))]
            )
            _assert_rows(tree_logits[m + i], chain[-1], dtype, exact, (case, name, i))
        _assert_rows(tree_logits[:m], chain[:m], dtype, exact, (case, name, "verified"))


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


def test_move_kv_refuses_what_does_not_pair_up_or_fit(tiny_model_dir):
    runner = _runner(tiny_model_dir, "float32", "cpu")
    num_slots = runner.num_blocks * BLOCK
    before = runner._pool.clone()
    runner.move_kv([], [])
    with pytest.raises(ValueError, match="one destination per source"):
        runner.move_kv([1, 2], [3])
    with pytest.raises(ValueError, match=f"slot {num_slots} is outside"):
        runner.move_kv([5], [num_slots])
    with pytest.raises(ValueError, match="slot -1 is outside"):
        runner.move_kv([-1], [5])
    assert torch.equal(runner._pool, before)


def test_seq_input_lists_must_cover_every_fed_token(tiny_model_dir):
    runner = _runner(tiny_model_dir, "float32", "cpu")
    with pytest.raises(ValueError, match="tree_mask has 2 entries for 3 fed tokens"):
        runner.prepare([SeqInput([5, 6, 7], 4, [1], 3, tree_mask=[-1, -1])])
    with pytest.raises(ValueError, match="positions has 4 entries for 3 fed tokens"):
        runner.prepare([SeqInput([5, 6, 7], 4, [1], 3, positions=[4, 5, 6, 7])])


@pytest.mark.parametrize("case", ["cpu-fp32", "cpu-bf16-fused", "torch-fp32", "torch-bf16"])
def test_all_ones_masks_change_no_bit_of_the_model(tiny_model_dir, case):
    """A step with masks of -1 (plain causal) is the step without masks, bit for bit,
    on every path a tree step takes instead (the torch backend's explicit mask)."""
    options = {k: v for k, v in MODEL_CASES[case].items() if k != "exact"}
    runner = _runner(tiny_model_dir, **options)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (20, 9, 30)]
    fed = [20, 1, 5]  # a prompt, a decode, a verification-sized chain
    blocks = _Blocks()
    logits = []
    for masked in (False, True):
        tables = [blocks.take(2) for _ in prompts]
        for prompt, table, n in zip(prompts[1:], tables[1:], fed[1:]):
            runner.forward([SeqInput(prompt[:-n], 0, table, 1)])
        step = [
            SeqInput(p[-n:], len(p) - n, t, n, tree_mask=[-1] * n if masked and i == 2 else None)
            for i, (p, t, n) in enumerate(zip(prompts, tables, fed))
        ]
        assert (runner.prepare(step).metadata.tree_masks is not None) == masked
        logits.append(runner.forward(step))
        # a lone prompt: SDPA's is_causal shortcut without masks
        mask = [-1] * len(prompts[2]) if masked else None
        logits.append(runner.forward([SeqInput(prompts[2], 0, blocks.take(2), 3, tree_mask=mask)]))
    assert torch.equal(logits[0], logits[2])
    assert torch.equal(logits[1], logits[3])


def test_mask_bits_past_63_are_dropped():
    got = as_mask_tensor([(1 << 64) | 5, (1 << 63) | 1, -1, (1 << 70) - 1], "cpu").tolist()
    assert got == [5, -(1 << 63) + 1, -1, -1]


def test_a_tree_of_more_than_64_fed_tokens(tiny_model_dir):
    """3 verified tokens and 63 nodes: the branching ones within the first 64 fed
    tokens, a chain past them (what a mask can say); a branch past them is refused."""
    runner = _runner(tiny_model_dir, "bfloat16", "cpu")
    rng = random.Random(5)
    m = 3
    parents = [-1] + [rng.randrange(i) for i in range(1, 58)] + list(range(57, 62))
    nodes = [rng.randrange(3, 250) for _ in parents]
    context = [rng.randrange(3, 250) for _ in range(10)]
    verified = [rng.randrange(3, 250) for _ in range(m)]
    blocks = _Blocks()
    table = blocks.take(6)
    runner.forward([SeqInput(context, 0, table, 1)])
    root = len(context) + m - 1
    masks = paths.ancestor_masks(parents, m, len(parents))
    positions = [*range(len(context), root + 1), *(root + d for d in paths.depths(parents, 63))]
    tree = SeqInput(verified + nodes, len(context), table, m + 63, positions, masks)
    tree_logits = runner.forward([tree])
    for i in [3, 30, 56, 57, 60, 61, 62]:  # fed tokens 6, 33, 59, 60, 63, 64, 65
        path = [nodes[k] for k in paths.node_path(parents, i)]
        chain_table = blocks.take(5)
        runner.forward([SeqInput(context, 0, chain_table, 1)])
        chain = runner.forward([SeqInput(verified + path, len(context), chain_table, 1)])
        assert torch.equal(tree_logits[m + i], chain[-1]), i
    branching = [*parents[:-1], 60]  # nodes 61 and 62 siblings at fed tokens 64, 65
    masks = paths.ancestor_masks(branching, m, len(parents))
    with pytest.raises(ValueError, match="tree_mask of fed token 65 hides one of fed tokens"):
        runner.prepare([SeqInput(verified + nodes, len(context), table, 1, positions, masks)])
