"""The one-call decoder against the layer-by-layer forward, at a chosen kernel level.

    .venv/bin/python scripts/bench_fused_decoder.py --dtype float32 --levels native,x86-64-v3

The default model as served (the .gguf's Q4_1 layers as stored; ``--model DIR`` another,
e.g. a bf16 checkpoint served in float32, its Linear layers on the fp32 kernel with
bf16 storage), one sequence with a 300-token context (``--batch N``: N sequences of
their own, the step of a busy server), one decode step's forward
(embedding to logits) timed with the decoder in one C call and layer by layer,
alternated call by call; per level the median of each, their ratio, the weight
stream's share of the read bound (the bytes a token reads / the step time, against
`bench bounds`' read GB/s measured with that level's kernels), and the same share for
all the step reads: the weights and the context's keys and values (as the cache holds
them). ``--kv-cache-dtype auto,bfloat16`` times the step over each KV cache dtype
(``bfloat16``: a bf16 cache under a float32 model), all alternated in one process, with
each one-call time's ratio to the first's. ``--team on,off`` the same for the one-call
decoder's kernels on one team of threads (on, the default) or in a region each;
``--kv-hugepages on,off`` the KV cache on 2 MB pages (the default) or 4 KB ones, and
``--scatter`` draws the context's blocks at random from a cache of the default size
(1 GiB) instead of laying them out in order, as a server's cache is after some traffic.
A prebuilt level runs this machine's CPU with
that level's code: the AVX2 level here shows what the AVX2 code does, on this machine's
memory and cores. Every level is loaded first; each round then times every level, the
one that goes first turning round by round, so levels share the hour.

``--waits`` builds each level with a clock at every barrier of the one-call decoder's
team (the kernels as shipped, plus two omp_get_wtime calls a barrier and thread) and
prints, after the times, where each thread waited for the other: a row per barrier site,
named by the statement before it, with its calls a step and each thread's microseconds a
step, and each thread's total as a share of the one-call step. A thread waits where the
other still works: a kernel split unevenly (one item of attention more), or run by one
thread alone (a batch-1 step's row-wise kernels: the rows are split, and there is one).
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--levels", default="native,x86-64-v3")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument(
        "--batch",
        type=int,
        default=1,
        help="sequences decoded in each step, each with --context tokens of its own",
    )
    parser.add_argument("--model", default=None, help="default: the built-in default model")
    parser.add_argument("--quantization", default="auto", choices=("auto", "none", "int8"))
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto, bfloat16, or both comma-separated (timed alternately)",
    )
    parser.add_argument(
        "--team",
        default="on",
        help="on, off, or both comma-separated: the one-call decoder's kernels on "
        "one team of threads, or an OpenMP region each (timed alternately)",
    )
    parser.add_argument(
        "--kv-hugepages",
        default="on",
        help="on, off, or both comma-separated: the KV cache on 2 MB pages or 4 KB ones",
    )
    parser.add_argument(
        "--scatter",
        action="store_true",
        help="the context's blocks at random places in a 1 GiB cache, not in order",
    )
    parser.add_argument(
        "--waits",
        action="store_true",
        help="time each thread's waits at every barrier of the one-call decoder's team",
    )
    args = parser.parse_args()

    from engine import envs
    from engine.attention import kv_cache_bytes_per_block
    from engine.benchmarks import bounds as bounds_mod
    from engine.core.model_runner import ModelRunner, SeqInput
    from engine.kernels import build as build_mod
    from engine.kernels import cpu as cpu_mod
    from engine.kernels import quant as quant_mod
    from engine.kernels.cpu import CpuKernels
    from engine.loader import load_model, resolve_kv_cache_dtype
    from engine.models import layers as layers_mod

    levels = [level.strip() for level in args.levels.split(",") if level.strip()]
    for level in levels:
        reason = build_mod.level_unrunnable(level)
        if reason is not None:
            parser.error(f"--levels {args.levels!r}: {reason}")
    kv_names = [kv.strip() for kv in args.kv_cache_dtype.split(",") if kv.strip()]
    teams = [t.strip() for t in args.team.split(",") if t.strip()]
    if not teams or any(t not in ("on", "off") for t in teams):
        parser.error(f"--team takes on, off or on,off, got {args.team!r}")
    pages = [t.strip() for t in args.kv_hugepages.split(",") if t.strip()]
    if not pages or any(t not in ("on", "off") for t in pages):
        parser.error(f"--kv-hugepages takes on, off or on,off, got {args.kv_hugepages!r}")
    caches = [(kv, page) for kv in kv_names for page in pages]
    variants = [(kv, team, page) for kv, page in caches for team in teams]
    if args.batch < 1:
        parser.error(f"--batch must be 1 or more, got {args.batch}")
    need = (args.context + 24) // 16 + 1  # blocks a sequence holds
    num_blocks = 1456 if args.scatter else 64
    num_blocks = max(num_blocks, args.batch * need + 1)
    built: dict[str, Path] = {}
    sites: list[str] = []
    if args.waits:
        print("building the kernels with the team's barriers timed (under a minute a level) ...",
              file=sys.stderr)  # fmt: skip
        source, sites = waits_source(build_mod.read_source())
        built = {level: build_mod.build_source(source, level) for level in levels}
    elif any(level != "native" for level in levels):
        print("building the prebuilt kernel levels asked for (under a minute) ...", file=sys.stderr)
        out = Path(tempfile.mkdtemp(prefix="specserve-levels-"))
        built = build_mod.prebuild_levels(out, levels)
    print(
        "| level | KV cache | team | huge pages | one call ms | vs first | layer by layer ms "
        "| one call vs layers | weight stream GB/s (share of read bound) "
        "| weights + KV GB/s (share) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")

    native_kernels = cpu_mod.cpu_kernels  # before use() replaces it: the native build's

    def use(kernels) -> None:  # the level whose kernels the modules hand out
        for module in (cpu_mod, layers_mod, quant_mod):  # bounds imports it from cpu_mod
            module.cpu_kernels = lambda k=kernels: k

    setups = {}  # level: its kernels, runners, one-call decoders and step
    for level in levels:
        if level in setups:
            continue
        kernels = CpuKernels(built[level]) if level in built else native_kernels()
        print(f"{level}: kernels {Path(kernels.lib._name).name}", file=sys.stderr, flush=True)
        use(kernels)
        loaded = load_model(
            args.model, dtype=args.dtype, device="cpu", quantization=args.quantization
        )
        runners, fused = {}, {}
        for kv, page in caches:
            kv_dtype = resolve_kv_cache_dtype(kv, loaded.dtype)
            with envs.overridden("SPECSERVE_KV_HUGEPAGES", "1" if page == "on" else "0"):
                runners[kv, page] = ModelRunner(
                    loaded, num_blocks=num_blocks, block_size=16, kv_dtype=kv_dtype
                )
            fused[kv, page] = runners[kv, page].model.model.fused  # bound to its caches
        if any(f is None for f in fused.values()):
            print(f"| {level} | - | - | - | - | - | - | (no one-call decoder here) | - | - |")
            continue
        ids = (
            random.Random(0).sample(range(1, num_blocks), need * args.batch)
            if args.scatter
            else list(range(1, need * args.batch + 1))
        )
        tables = [ids[i * need : (i + 1) * need] for i in range(args.batch)]
        seqs = [
            [100 + (i + 7 * b) % 1000 for i in range(args.context + 1)] for b in range(args.batch)
        ]
        for key, runner in runners.items():
            runner.model.model.fused = fused[key]
            runner.model.bind_kv_caches(runner.kv_caches)
            for tokens, blocks in zip(seqs, tables, strict=True):
                runner.forward([SeqInput(tokens[:-1], 0, blocks, 1)])
        step = [
            SeqInput(tokens[-1:], args.context, blocks, 1)
            for tokens, blocks in zip(seqs, tables, strict=True)
        ]
        meta = runners[caches[0]].prepare(step).metadata
        print(
            f"{level}: each step decodes {len(meta.seq_lens_cpu)} sequences, "
            f"{sum(meta.seq_lens_cpu)} positions of K/V",
            file=sys.stderr,
            flush=True,
        )
        setups[level] = (kernels, loaded, runners, fused, step)
    # Every level in every round, the level that goes first rotating round by round: a
    # process's first steps after loading measured slower (a Zen 4, 2026-12-06), and
    # the machine's speed drifts, so levels timed one after the other are not compared.
    order = list(setups)
    times = {(lv, v, one): [] for lv in order for v in variants for one in (True, False)}
    waits = {(lv, v): TeamWaits() for lv in order for v in variants} if args.waits else {}
    for r in range(args.rounds):
        for level in order[r % len(order) :] + order[: r % len(order)]:
            kernels, _, runners, fused, step = setups[level]
            use(kernels)
            team_before = kernels.decoder_team
            for kv, team, page in variants:
                runner = runners[kv, page]
                runner.model.bind_kv_caches(runner.kv_caches)  # one model, each its caches
                kernels.set_decoder_team(team == "on")
                for one_call in (True, False):
                    runner.model.model.fused = fused[kv, page] if one_call else None
                    prepared = runner.prepare(step)
                    if one_call and waits:
                        waits[level, (kv, team, page)].clear(kernels.lib)
                    start = time.perf_counter()
                    runner.execute(prepared)
                    times[level, (kv, team, page), one_call].append(time.perf_counter() - start)
                    if one_call and waits:
                        waits[level, (kv, team, page)].add(kernels.lib)
            kernels.set_decoder_team(team_before)
        if r % 10 == 9:
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    for level in order:
        kernels, loaded, runners, _, _ = setups[level]
        use(kernels)
        streamed = _streamed_bytes(loaded.model)
        bound = bounds_mod.measure()
        first = statistics.median(times[level, variants[0], True])
        for kv, team, page in variants:
            runner = runners[kv, page]
            one, layers = (
                statistics.median(times[level, (kv, team, page), k]) for k in (True, False)
            )
            arch = runner.arch  # the context's K/V: one block of one token a position
            kv_bytes = (
                args.batch
                * (args.context + 1)
                * kv_cache_bytes_per_block(
                    arch.num_layers, 1, arch.num_kv_heads, arch.head_dim, runner.kv_caches[0].dtype
                )
            )
            shares = []
            for nbytes in (streamed, streamed + kv_bytes):
                gbps = nbytes / one / 1e9
                shares.append(f"{gbps:.1f} ({gbps / bound.read_gbps:.0%} of {bound.read_gbps:.1f})")
            cache = str(runner.kv_caches[0].dtype).removeprefix("torch.")
            print(f"| {level} | {cache} | {team} | {page} | {1e3 * one:.2f} | {one / first:.3f} | "
                  f"{1e3 * layers:.2f} | {layers / one:.2f}x | {shares[0]} | {shares[1]} |",
                  flush=True)  # fmt: skip
    for (level, variant), w in waits.items():
        kv, team, page = variant
        one = statistics.median(times[level, variant, True])
        print(f"\nteam waits, {level}, KV cache {kv}, team {team}, huge pages {page}: "
              f"a step of {1e3 * one:.2f} ms, {args.rounds} steps")  # fmt: skip
        print(w.table(sites, args.rounds, one))
    return 0


def waits_source(source: bytes) -> tuple[bytes, list[str]]:
    """The kernels' source with each barrier of the one-call decoder's team
    (DECODER_TEAM's team_barrier calls) timed per thread, and the sites' names: the
    statement before each barrier, shortened."""
    text = source.decode()
    anchor = "/* Dynamic phase `phase`"  # the comment after team_barrier's definition
    at, start = text.find(anchor), text.find("#define DECODER_TEAM(")
    end = text.find("\nDECODER_TEAM(", start)
    if not 0 <= at < start < end:
        raise SystemExit("error: --waits cannot find the team's barriers in the kernels' source")
    lines = text[start:end].split("\n")
    sites = []
    for i, line in enumerate(lines):
        if "team_barrier(&tm, nt);" not in line:
            continue
        lines[i] = line.replace(
            "team_barrier(&tm, nt);", f"team_barrier_site(&tm, nt, {len(sites)}, tid);"
        )
        sites.append(_statement_before(lines, i))
    if not sites or len(sites) > _MAX_SITES:
        raise SystemExit(f"error: --waits found {len(sites)} barriers in DECODER_TEAM")
    text = text[:at] + _WAITS_C + text[at:start] + "\n".join(lines) + text[end:]
    return text.encode(), sites


def _statement_before(lines: list[str], i: int) -> str:
    """The statement that ends before lines[i] (macro lines: without the continuations),
    on one line and shortened; an opening brace, or a counter's ++, is passed over for the
    statement before it."""
    code = [line.rstrip().removesuffix("\\").strip() for line in lines[:i]]
    j = len(code) - 1
    while True:
        while j > 0 and (not code[j] or code[j].endswith("{") or code[j] == "}"
                         or code[j].startswith("/*")):  # fmt: skip
            j -= 1
        if not re.fullmatch(r"\w+\+\+;", code[j]):
            break
        j -= 1
    first = j
    while first > 0:
        text = " ".join(code[first : j + 1])
        balanced = text.count("(") == text.count(")")
        if balanced and (not code[first - 1] or code[first - 1].endswith((";", "{", "}", "*/"))):
            break
        first -= 1
    words = " ".join(" ".join(code[first : j + 1]).split())
    return words if len(words) <= 60 else words[:57] + "..."


_MAX_SITES = 64
_WAITS_C = f"""
/* bench_fused_decoder.py --waits: each thread's waits at each barrier site of the
 * one-call decoder's team (seconds and calls; a thread's row its own cache lines),
 * read and cleared by specserve_team_waits. */
static double team_wait_s[{_MAX_SITES}][{_MAX_SITES}];
static long long team_wait_n[{_MAX_SITES}][{_MAX_SITES}];
INLINE void team_barrier_site(struct team *tm, int nt, int site, int tid) {{
    const double t0 = omp_get_wtime();
    team_barrier(tm, nt);
    if (tid < {_MAX_SITES}) {{
        team_wait_s[tid][site] += omp_get_wtime() - t0;
        team_wait_n[tid][site]++;
    }}
}}
void specserve_team_waits(double *s, long long *n, int clear) {{
    if (s) memcpy(s, team_wait_s, sizeof team_wait_s);
    if (n) memcpy(n, team_wait_n, sizeof team_wait_n);
    if (!clear) return;
    memset(team_wait_s, 0, sizeof team_wait_s);
    memset(team_wait_n, 0, sizeof team_wait_n);
}}

"""


class TeamWaits:
    """One variant's waits, summed over its timed steps: [thread][site] seconds and calls."""

    def __init__(self) -> None:
        import numpy as np

        self.seconds = np.zeros((_MAX_SITES, _MAX_SITES))
        self.calls = np.zeros((_MAX_SITES, _MAX_SITES), dtype=np.int64)

    @staticmethod
    def clear(lib) -> None:
        """Drops what the library counted (the loading's and warm-up's calls)."""
        lib.specserve_team_waits(None, None, 1)

    def add(self, lib) -> None:
        """Adds what the library counted since it was last cleared, and clears it."""
        import ctypes

        import numpy as np

        s = np.zeros((_MAX_SITES, _MAX_SITES))
        n = np.zeros((_MAX_SITES, _MAX_SITES), dtype=np.int64)
        lib.specserve_team_waits(ctypes.c_void_p(s.ctypes.data), ctypes.c_void_p(n.ctypes.data),
                                 ctypes.c_int(1))  # fmt: skip
        self.seconds += s
        self.calls += n

    def table(self, sites: list[str], steps: int, step_s: float) -> str:
        threads = [t for t in range(_MAX_SITES) if self.calls[t].any()]
        if not threads:
            return "(no step ran on the team)"
        head = " | ".join(f"thread {t} us a step" for t in threads)
        out = [f"| site | after | calls a step | {head} |", "|---" * (3 + len(threads)) + "|"]
        for i, name in enumerate(sites):
            if not self.calls[threads[0], i]:
                continue
            us = " | ".join(f"{1e6 * self.seconds[t, i] / steps:.1f}" for t in threads)
            out.append(f"| {i} | `{name}` | {self.calls[threads[0], i] / steps:g} | {us} |")
        per_step = [self.seconds[t].sum() / steps for t in threads]
        totals = " | ".join(f"{1e6 * w:.1f} ({w / step_s:.1%})" for w in per_step)
        out.append(
            f"| all | (share of the step) | {self.calls[threads[0]].sum() / steps:g} | {totals} |"
        )
        return "\n".join(out)


def _streamed_bytes(model) -> int:
    import torch

    """Bytes of weights one decode step reads: every parameter and packed weight but the
    embedding table (a lookup of one row), plus the head's when it is tied."""
    seen, total = set(), 0
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.data_ptr() in seen or "rotary" in name:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    for module in model.modules():
        for attr in ("weight_q", "packed_weight"):
            w = getattr(module, attr, None)
            data = getattr(w, "data", w)
            if isinstance(data, torch.Tensor) and data.data_ptr() not in seen:
                seen.add(data.data_ptr())
                total += data.numel() * data.element_size()
    embed = model.model.embed_tokens
    table = getattr(getattr(embed, "weight_q", None), "data", getattr(embed, "weight", None))
    tied = getattr(model.lm_head, "weight_q", None) is getattr(embed, "weight_q", object())
    if table is not None and not tied:
        total -= table.numel() * table.element_size()
    return total


if __name__ == "__main__":
    sys.exit(main())
