"""The one-call decoder on one team of threads (engine/kernels/decoder_kernels.c,
DECODER_TEAM): every kernel of every layer inside one OpenMP region, its threads meeting
at a spinning barrier between kernels. It must compute what the decoder with a region
per kernel computes, bit for bit (logits and the KV cache it writes), whatever the
batch (prefills of many query tiles, decodes whose attention splits by key chunk,
verification queries, token trees), the thread count (more threads than CPUs too: the
waiting threads then yield), the activations (float32, bf16), the Linear layers
(quantized, on vpdpbusd or AMX tiles, or dequantized to bf16 on AMX-BF16 tiles; float32
or bf16-stored under float32; bf16 on each bf16 kernel, with a qkv bias too) and the KV
cache dtype; run wherever every Linear has a team form (the bf16 Linear on AMX tiles has
none); and refuse what the region-per-kernel decoder refuses."""

from __future__ import annotations

import os
import random

import pytest
import torch

from engine.core.model_runner import ModelRunner, SeqInput
from engine.kernels.cpu import cpu_kernels
from engine.loader import load_model
from engine.spec_decode.paths import ancestor_masks

BLOCK = 16


@pytest.fixture()
def kernels():
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no CPU kernels on this machine")
    before = kernels.decoder_team
    yield kernels
    kernels.set_decoder_team(before)


@pytest.fixture()
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _runner(
    path: str, kv_dtype: torch.dtype | None, dtype: str = "float32", quantization: str = "auto"
) -> ModelRunner:
    loaded = load_model(path, dtype=dtype, device="cpu", quantization=quantization)
    runner = ModelRunner(loaded, num_blocks=96, block_size=BLOCK, kv_dtype=kv_dtype)
    assert runner.model.model.fused is not None, f"a {dtype} model runs in one call"
    return runner


def _steps(vocab: int) -> list[list[SeqInput]]:
    """Steps over sequences 0-3 (blocks of their own): a 300-token prompt (ten query
    tiles) beside short ones, decodes (a lone one splits attention by key chunk), a
    verification query, a token tree, and 40 one-row sequences in one batch."""
    rng = random.Random(1)

    def toks(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    blocks = {s: list(range(1 + 22 * s, 1 + 22 * (s + 1))) for s in range(4)}
    lens = {0: 300, 1: 5, 2: 1, 3: 40}
    steps = [[SeqInput(toks(n), 0, blocks[s], 1) for s, n in lens.items()]]
    steps.append([SeqInput(toks(1), lens[s], blocks[s], 1) for s in range(4)])
    lens = {s: n + 1 for s, n in lens.items()}
    steps.append([SeqInput(toks(1), lens[0], blocks[0], 1)])  # alone: split key chunks
    lens[0] += 1
    verify = SeqInput(toks(6), lens[1], blocks[1], 6)  # 1 + 5 drafts
    steps.append([verify, SeqInput(toks(1), lens[2], blocks[2], 1)])
    lens[1] += 6
    lens[2] += 1
    # a tree: the root (the last verified token) and nodes 0..4, parents below
    parents = [-1, -1, 0, 1, 2]
    depth = [1, 1, 2, 2, 3]
    start = lens[3]
    steps.append(
        [
            SeqInput(
                toks(6),
                start,
                blocks[3],
                6,
                positions=[start] + [start + d for d in depth],
                tree_mask=ancestor_masks(parents, 1, len(parents)),
            ),
            SeqInput(toks(1), lens[0], blocks[0], 1),
        ]
    )
    lens[0] += 1
    # 40 sequences of one row: the tables of sequence 0's blocks, shared read-only
    steps.append([SeqInput(toks(1), lens[0], blocks[0], 1) for _ in range(40)])
    return steps


def _run(runner: ModelRunner, kernels, team: bool) -> tuple[list[torch.Tensor], list]:
    kernels.set_decoder_team(team)
    logits = [runner.forward(step) for step in _steps(runner.arch.vocab_size)]
    return logits, [t.clone() for t in runner.kv_caches]


def _compare(kernels, make_runner, team_runs: bool, between=lambda: None) -> None:
    """The steps through a runner with the team on, then (after ``between``) through
    another with it off: the same logits and KV caches bit for bit; the team ran every
    call if team_runs, none otherwise (a region per kernel computed both), and never
    with it off."""
    calls = kernels.decoder_team_calls
    team = _run(make_runner(), kernels, True)
    ran = kernels.decoder_team_calls - calls
    assert (ran > 0) is team_runs, f"the team ran {ran} calls"
    between()
    calls = kernels.decoder_team_calls
    regions = _run(make_runner(), kernels, False)
    assert kernels.decoder_team_calls == calls, "the team ran while turned off"
    for ours, theirs in zip(team[0], regions[0], strict=True):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(team[1], regions[1], strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("num_threads", [2, 3])
@pytest.mark.parametrize("kv", ["auto", "bfloat16"])
@pytest.mark.parametrize("checkpoint", ["gguf", "fp32", "bf16"])
def test_the_team_computes_what_a_region_per_kernel_computes(
    kernels, threads, num_threads, kv, checkpoint, tiny_gguf_path, tiny_model_dir,
    tiny_bf16_checkpoint,
):  # fmt: skip
    if checkpoint != "gguf" and not kernels.has_f32_linear:
        pytest.skip("a build without FMA: float Linear layers run on oneDNN, layer by layer")
    path = {"gguf": tiny_gguf_path, "fp32": tiny_model_dir, "bf16": tiny_bf16_checkpoint}
    kv_dtype = torch.bfloat16 if kv == "bfloat16" else None
    threads(num_threads)
    _compare(kernels, lambda: _runner(path[checkpoint], kv_dtype), team_runs=True)


@pytest.fixture(params=["vdpbf16ps", "fma", "amx"])
def bf16_linear(request, kernels):
    """The kernels with each bf16 Linear kernel this build has, in turn (process-wide;
    weights are packed at load, after the switch); AMX's on ``on_amx_tiles``."""
    if request.param == "amx":
        kernels = request.getfixturevalue("on_amx_tiles")
    if request.param not in kernels.bf16_linear_modes:
        pytest.skip(f"no {request.param} bf16 Linear kernel here")
    before = kernels.set_bf16_linear(request.param)
    yield kernels
    kernels.set_bf16_linear(before)


@pytest.mark.parametrize("num_threads", [2, 3])
@pytest.mark.parametrize("checkpoint", ["bf16", "qwen2"])  # qwen2: a qkv bias
def test_the_bf16_team_computes_what_a_region_per_kernel_computes(
    threads, bf16_linear, num_threads, checkpoint, tiny_bf16_checkpoint, tiny_model_factory
):
    """A bf16 model's float Linear layers on each bf16 kernel: vdpbf16ps and widen +
    FMA run on the team; AMX's tiles (a tile configuration per region) do not, and the
    call runs a region per kernel."""
    path = tiny_bf16_checkpoint if checkpoint == "bf16" else tiny_model_factory("qwen2")
    threads(num_threads)
    team_runs = bf16_linear.bf16_linear != "amx"
    _compare(bf16_linear, lambda: _runner(path, None, "bfloat16"), team_runs=team_runs)


@pytest.mark.parametrize("num_threads", [2, 3])
def test_the_bf16_team_runs_quantized_layers(kernels, threads, num_threads, tiny_gguf_path):
    """A GGUF's Q4_1 Linear layers under bf16 activations (the default model on an
    AVX512-BF16 CPU): on the team whatever the bf16 Linear kernel (Q4_1 never takes the
    AMX path by default)."""
    threads(num_threads)
    _compare(kernels, lambda: _runner(tiny_gguf_path, None, "bfloat16"), team_runs=True)


@pytest.mark.parametrize("rule", [1, 9])
@pytest.mark.parametrize("quantization", ["auto", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_team_runs_quantized_layers_on_amx_tiles(
    on_amx_tiles, threads, rule, quantization, dtype, tiny_gguf_path
):
    """Quantized Linear layers on AMX tiles inside the team (every row block from
    ``rule`` rows: 1 puts even a lone row on tiles, 9 leaves short last blocks on
    vpdpbusd), Q4_1 as the GGUF stores it and Q8_0 made at load: the same bits as a
    region per kernel with the tiles off, so the path a call takes changes nothing."""
    from engine.kernels.quant import quant_ops

    kernels, ops = on_amx_tiles, quant_ops()
    if ops is None or ops.amx_min_rows == 0:
        pytest.skip("no AMX-INT8 path in these kernels (the quantized Linear off zmm)")
    threads(2)
    before = ops.amx_min_rows
    ops.set_amx_min_rows(rule)
    try:
        tiles = ops.amx_calls
        _compare(
            kernels,
            lambda: _runner(tiny_gguf_path, None, dtype, quantization),
            team_runs=True,
            between=lambda: ops.set_amx_min_rows(0),
        )
    finally:
        ops.set_amx_min_rows(before)
    assert ops.amx_calls > tiles, "no call ran on tiles"


@pytest.mark.parametrize("rule", [1, -1])
@pytest.mark.parametrize("quantization", ["auto", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_team_runs_quantized_layers_on_bf16_tiles(
    on_amx_tiles, threads, rule, quantization, dtype, tiny_gguf_path
):
    """The not batch invariant path (``--no-batch-invariance``: quantized weights
    dequantized to bf16 on AMX-BF16 tiles) inside the team: every call on it (rule 1),
    or by format (-1: the steps' 40-row batch and 300-token prompt on it, the rest on
    the int8 paths); the same bits as a region per kernel under the same rule."""
    from engine.kernels.quant import quant_ops

    kernels, ops = on_amx_tiles, quant_ops()
    ops_before = None if ops is None else ops.bf16_min_rows
    if ops is None:
        pytest.skip("no quantized Linear in these kernels")
    threads(2)
    ops.set_bf16_min_rows(rule)
    try:
        calls = ops.bf16_calls
        _compare(
            kernels, lambda: _runner(tiny_gguf_path, None, dtype, quantization), team_runs=True
        )
    finally:
        ops.set_bf16_min_rows(ops_before)
    assert (ops.bf16_calls > calls) == ops.bf16_tiles, "the rule ran no call on bf16 tiles"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_team_is_what_one_thread_computes(kernels, threads, dtype, tiny_gguf_path):
    """One thread runs no team (nothing to meet): the team's split of every kernel
    among threads changes no bit against one thread doing all of it."""
    kernels.set_decoder_team(True)
    threads(2)
    team = _run(_runner(tiny_gguf_path, None, dtype), kernels, True)
    threads(1)
    calls = kernels.decoder_team_calls
    alone = _run(_runner(tiny_gguf_path, None, dtype), kernels, True)
    assert kernels.decoder_team_calls == calls, "one thread ran a team"
    for ours, theirs in zip(team[0] + team[1], alone[0] + alone[1], strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_more_threads_than_cpus_still_finish(kernels, threads, dtype, tiny_gguf_path):
    """Threads past the CPUs: a waiting thread yields its CPU after its spins, so the
    team makes progress (and computes the same bits) instead of spinning the others
    out."""
    threads(4 * max(1, len(os.sched_getaffinity(0))))
    _compare(kernels, lambda: _runner(tiny_gguf_path, None, dtype), team_runs=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("team", [True, False])
def test_a_position_past_the_rotary_table_is_refused_either_way(
    kernels, threads, team, dtype, tiny_gguf_path
):
    threads(2)
    kernels.set_decoder_team(team)
    runner = _runner(tiny_gguf_path, None, dtype)
    far = runner.model.config.max_position_embeddings
    with pytest.raises(Exception, match="(?i)position"):
        runner.forward([SeqInput([3, 4], 0, [1], 2, positions=[0, far], tree_mask=[1, 3])])


def test_the_setting_reads_back(kernels):
    kernels.set_decoder_team(False)
    assert kernels.decoder_team is False
    assert kernels.set_decoder_team(True) is False
    assert kernels.decoder_team is True


def test_the_environment_turns_it_off(monkeypatch):
    """SPECSERVE_DECODER_TEAM=0: the process's kernels start with the team off."""
    from engine.kernels import cpu as cpu_mod

    for value, on in (("0", False), ("1", True)):
        monkeypatch.setenv("SPECSERVE_DECODER_TEAM", value)
        cpu_mod.cpu_kernels.cache_clear()
        try:
            kernels = cpu_mod.cpu_kernels()
            if kernels is None:
                pytest.skip("no CPU kernels on this machine")
            assert kernels.decoder_team is on
        finally:
            monkeypatch.delenv("SPECSERVE_DECODER_TEAM")
            cpu_mod.cpu_kernels.cache_clear()
            cpu_mod.cpu_kernels().set_decoder_team(True)


@pytest.mark.parametrize("num_threads", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_wide_layers_split_alike_whatever_the_thread_count(
    kernels, threads, num_threads, dtype, tiny_gguf_factory
):
    """Linear layers wide enough that the team hands out their last quarter of output
    tiles in guided takes of several groups (gate_up's 4,160 outputs and the head's
    4,130, the takes shrinking to one group): the bits of a region per kernel, and of
    one thread."""
    path = tiny_gguf_factory(intermediate_size=2080, vocab_size=4130)
    threads(num_threads)
    _compare(kernels, lambda: _runner(path, None, dtype), team_runs=True)
    team = _run(_runner(path, None, dtype), kernels, True)
    threads(1)
    alone = _run(_runner(path, None, dtype), kernels, True)
    for ours, theirs in zip(team[0] + team[1], alone[0] + alone[1], strict=True):
        assert torch.equal(ours, theirs)
