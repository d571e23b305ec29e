"""`specserve bench bounds`: this machine's limits, printed beside every benchmark table.

Machines of one kind differ by up to 2x in memory bandwidth, and one machine's moves
between minutes; a tok/s figure means little without what the machine could do at that
moment. Two bounds, measured in under a second on torch's thread count:

- **read GB/s**: the best of 5 passes summing a 256 MiB buffer (larger than any L3 here):
  the ceiling of a batch-1 decode step, which reads every weight once.
- **multiply-add peaks** (G multiply-adds/s) of the instructions the CPU kernels use:
  fp32 FMA, bf16 ``vdpbf16ps`` and int8 ``vpdpbusd`` (the better of its 512- and 256-bit
  forms; on AVX2 without VNNI ``vpmaddubsw`` + ``vpaddw``, the step of the quantized
  kernel's Q4 blocks there), and on a CPU with AMX its int8 ``tdpbssd`` and bf16
  ``tdpbf16ps``, each a register-only loop of independent chains on every thread: the
  ceiling of a large batch's Linear layers.

A result's share of its bound: batch-1 tok/s x bytes read per token / read GB/s, or
step multiply-adds / peak.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

_READ_BYTES = 256 << 20
_ITERS = 1_000_000  # register-only iterations: ~40 ms per instruction on 2 Zen 4 cores


@dataclass(frozen=True)
class Bounds:
    num_threads: int
    read_gbps: float
    fp32_fma_gmacs: float | None
    bf16_gmacs: float | None
    int8_gmacs: float | None
    # the instruction int8_gmacs measured (AVX2 without VNNI: vpmaddubsw + vpaddw, the
    # quantized kernel's Q4 step there), and AMX's tdpbssd where the CPU and build have it
    int8_instruction: str = "vpdpbusd"
    amx_int8_gmacs: float | None = None
    amx_bf16_gmacs: float | None = None  # tdpbf16ps, likewise

    def line(self) -> str:
        """One line for the top of a table."""

        def peak(name: str, value: float | None) -> str:
            return f"{name} {value:.0f}" if value is not None else f"{name} n/a"

        peaks = ", ".join(
            [
                peak("fp32 FMA", self.fp32_fma_gmacs),
                peak("bf16 vdpbf16ps", self.bf16_gmacs),
                peak(f"int8 {self.int8_instruction}", self.int8_gmacs),
            ]
            + ([peak("int8 AMX tdpbssd", self.amx_int8_gmacs)] if self.amx_int8_gmacs else [])
            + ([peak("bf16 AMX tdpbf16ps", self.amx_bf16_gmacs)] if self.amx_bf16_gmacs else [])
        )
        return (
            f"machine bounds ({self.num_threads} threads): read {self.read_gbps:.1f} GB/s; "
            f"multiply-add peaks (G/s) {peaks}"
        )


def measure(num_threads: int | None = None) -> Bounds | None:
    """The bounds now, or None where the CPU kernels cannot be built (no compiler)."""
    import torch

    from engine.kernels.cpu import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        return None
    threads = num_threads or torch.get_num_threads()
    buffer = torch.ones(_READ_BYTES // 8, dtype=torch.int64)  # touched: pages are real
    read = kernels.read_gbps(buffer, 5, threads)
    del buffer
    int8 = [v for v in (kernels.peak_gmacs(k, _ITERS, threads) for k in (2, 3)) if v]
    return Bounds(
        num_threads=threads,
        read_gbps=read,
        fp32_fma_gmacs=kernels.peak_gmacs(0, _ITERS, threads),
        bf16_gmacs=kernels.peak_gmacs(1, _ITERS, threads),
        int8_gmacs=max(int8) if int8 else None,
        int8_instruction=int8_instruction(kernels),
        amx_int8_gmacs=kernels.peak_gmacs(4, _ITERS, threads),
        amx_bf16_gmacs=kernels.peak_gmacs(5, _ITERS, threads),
    )


def int8_instruction(kernels) -> str:
    """What the int8 peak of ``kernels``' build measures: vpdpbusd, or on AVX2 without
    VNNI vpmaddubsw + vpaddw, its quantized kernel's Q4 step."""
    from engine.kernels.quant import QuantOps

    return "vpmaddubsw" if QuantOps(kernels.lib).path == "avx2" else "vpdpbusd"


def line(num_threads: int | None = None) -> str:
    """``measure()``'s line, or why there is none."""
    bounds = measure(num_threads)
    if bounds is None:
        return "machine bounds: not measured (the CPU kernels are off or could not be built)"
    return bounds.line()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--num-threads", type=int, default=None, help="threads (default: torch's, one per core)"
    )
    parser.add_argument("--json", default=None, help="also write the numbers to this file")


def run(args: argparse.Namespace) -> int:
    if args.num_threads is not None and args.num_threads < 1:
        print(f"--num-threads must be >= 1, got {args.num_threads}", file=sys.stderr)
        return 2
    bounds = measure(args.num_threads)
    if bounds is None:
        print("the CPU kernels are off or could not be built: nothing to measure with",
              file=sys.stderr)  # fmt: skip
        return 1
    print(bounds.line())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(bounds), f, indent=2)
    return 0
