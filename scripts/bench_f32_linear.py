"""specserve's float32 Linear kernel against oneDNN's fp32 GEMM, on the default model's
Linear shapes, side by side in one process.

    .venv/bin/python scripts/bench_f32_linear.py shapes [--rows 1,4,8,32,256] [--level L]
    .venv/bin/python scripts/bench_f32_linear.py export-bf16 DIR

``shapes``: per shape and row count, the best of 3 timed loops each of oneDNN (weights
prepacked by ``torch.ops.mkldnn._reorder_linear_weight``, rows padded to the bucket
PackedLinear gives oneDNN), the kernel with fp32 weights and with the same weights
stored as bf16 (values rounded to bf16 first, so both storages compute the same bits),
and the ratios; then the totals of one decode step's Linear layers (30 layers + the
49k-row head). The machine's bounds are printed first. The weights are random and the
loops repeat them, so a shape smaller than the last-level cache is timed partly from
it: the step-level numbers are ``bench offline``'s.

``export-bf16``: the default model as an HF directory with its weights rounded to bf16
(what a bf16 checkpoint of that shape is: most published checkpoints are bf16), for
``specserve bench offline --model DIR --dtype float32``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# SmolLM2-135M's Linear layers, [out, in]: qkv, o, gate_up, down; the tied head.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
LAYERS = 30


def _best_ms(fn, args: tuple, reps: int) -> float:
    fn(*args)
    fn(*args)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            fn(*args)
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e3


def shapes(args) -> int:
    import torch

    from engine.benchmarks import bounds as bounds_mod
    from engine.kernels.cpu import cpu_kernels
    from engine.models.weights import row_bucket

    kernels = cpu_kernels()
    if kernels is None or not kernels.has_f32_linear:
        print("error: no float32 Linear kernel here (needs a CPU with FMA)", file=sys.stderr)
        return 1
    bound = bounds_mod.measure()
    print(bound.line() if bound is not None else "machine bounds: n/a (no kernels)")
    print(f"kernels: {kernels.path.name}, fp32 tile {kernels.linear_tiles[torch.float32]}")
    print("| rows | shape | oneDNN ms | kernel fp32 ms | vs oneDNN | kernel bf16-stored ms "
          "| vs oneDNN |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for rows in [int(r) for r in args.rows.split(",")]:
        step = [0.0, 0.0, 0.0]
        for n, k in SHAPES:
            weight = torch.randn(n, k, generator=gen).to(torch.bfloat16).float()
            x = torch.randn(rows, k, generator=gen)
            padded = torch.randn(row_bucket(rows), k, generator=gen)
            onednn = torch.ops.mkldnn._reorder_linear_weight(weight)
            f32 = kernels.pack_linear_weight(weight)
            bf16 = kernels.pack_linear_weight(weight, torch.bfloat16)
            reps = max(2, int(200e6 / (n * k * max(rows, 4))))
            calls = [
                (torch.ops.mkldnn._linear_pointwise, (padded, onednn, None, "none", [], "")),
                (kernels.linear, (x, f32, None, n)),
                (kernels.linear, (x, bf16, None, n)),
            ]
            times = [_best_ms(fn, call_args, reps) for fn, call_args in calls]
            count = 1 if n == SHAPES[-1][0] else LAYERS
            step = [s + count * t for s, t in zip(step, times, strict=True)]
            print(f"| {rows} | [{n}, {k}] | {times[0]:.3f} | {times[1]:.3f} | "
                  f"{times[0] / times[1]:.2f}x | {times[2]:.3f} | {times[0] / times[2]:.2f}x |",
                  flush=True)  # fmt: skip
        print(f"| {rows} | step's Linears | {step[0]:.2f} | {step[1]:.2f} | "
              f"{step[0] / step[1]:.2f}x | {step[2]:.2f} | {step[0] / step[2]:.2f}x |",
              flush=True)  # fmt: skip
    return 0


def export_bf16(args) -> int:
    import torch
    from safetensors.torch import load_file, save_file

    from engine.default_model import default_gguf_path
    from engine.models.gguf_convert import ensure_converted

    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    print("converting the default model (once, ~20 s) ...", file=sys.stderr, flush=True)
    source = ensure_converted(default_gguf_path())
    state = load_file(str(source / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(out / "model.safetensors"))
    for item in source.iterdir():
        if item.name != "model.safetensors":
            (out / item.name).write_bytes(item.read_bytes())
    config = (out / "config.json").read_text()
    (out / "config.json").write_text(config.replace('"float32"', '"bfloat16"'))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("shapes", help="the kernel vs oneDNN per Linear shape")
    p.add_argument("--rows", default="1,4,8,32,256")
    sub.add_parser("export-bf16", help="the default model as a bf16 HF directory").add_argument(
        "dir"
    )
    args = parser.parse_args()
    return shapes(args) if args.command == "shapes" else export_bf16(args)


if __name__ == "__main__":
    sys.exit(main())
