"""`specserve bench step`: where a decode step's time goes, kernels against torch ops.

Runs the same batch twice on CPU in one dtype (``--dtype``, float32 or bfloat16; the KV
cache in it, or bf16 under float32 with ``--kv-cache-dtype bfloat16``): once
with specserve's compiled kernels (the default: the `cpu` attention backend, fused norm /
rotary / SiLU) and once with torch ops only (``SPECSERVE_CPU_KERNELS=0``, the `torch`
attention backend). For the decode
steps (every request already prefilled) it splits the time of a step into the Linear
layers, the LM head, attention (KV write included), norm + rotary + SiLU, the rest of
the forward (Python, embedding) and the host side (scheduling, batch building,
sampling, detokenizing), and prints the ratio of the two runs.

The split comes from timers wrapped around those calls for the duration of the run
(about a microsecond each, a few hundred per step), so both runs go layer by layer
(``SPECSERVE_FUSED_DECODER=0``). Where a bf16 model's layers run in one kernel call
(engine/kernels/decoder.py), a third run times that step whole, without timers.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from engine.benchmarks.workloads import load_prompts
from engine.config import KV_CACHE_DTYPES

COMPONENTS = ("linear", "lm_head", "attention", "norm_rope_silu", "forward_rest", "host")
DTYPES = ("float32", "bfloat16")  # the dtypes the compiled CPU kernels serve
QUANTIZATIONS = ("none", "auto", "int8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="default: the built-in default model")
    parser.add_argument("--workload", default="chat", help="chat, grounded or a JSONL file")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests decoded together")
    parser.add_argument("--output-len", type=int, default=64, help="tokens decoded per request")
    parser.add_argument(
        "--num-threads", type=int, default=None, help="torch CPU threads (default: one per core)"
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="model and activation dtype"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="auto: the KV cache in --dtype; bfloat16: a bf16 cache under float32",
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="the weights' form (auto: a .gguf's quantized tensors as stored; the torch-ops "
        "run has no quantized kernel and dequantizes)",
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.kernels.cpu import cpu_kernels

    if args.num_prompts < 1 or args.output_len < 2:
        raise ValueError("--num-prompts must be >= 1 and --output-len >= 2")
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    results = {}
    runs = [("kernels", True, False), ("torch ops", False, False)]
    built = cpu_kernels()
    if args.dtype == "bfloat16" and built is not None and built.has_bf16_linear:
        runs.append(("one-call decoder", True, True))
    for label, kernels, fused in runs:
        print(f"running with {label}...", file=sys.stderr, flush=True)
        results[label] = _profile(args, kernels, fused)
    _print(args, results)
    return 0


def _profile(args: argparse.Namespace, kernels: bool, fused: bool) -> dict[str, float]:
    from engine import envs
    from engine.benchmarks.offline import tokenize_prompts
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.io.sampling_params import SamplingParams
    from engine.kernels.cpu import cpu_kernels, cpu_kernels_enabled

    with cpu_kernels_enabled(kernels), envs.overridden("SPECSERVE_FUSED_DECODER", str(int(fused))):
        if kernels and cpu_kernels() is None:
            raise RuntimeError("the compiled CPU kernels are unavailable on this machine")
        engine = LLMEngine(
            EngineConfig(
                model=args.model,
                device="cpu",
                dtype=args.dtype,
                kv_cache_dtype=args.kv_cache_dtype,
                attn_backend="cpu" if kernels else "torch",
                num_threads=args.num_threads,
                quantization=args.quantization if kernels else "none",
            )
        )
        prompts = tokenize_prompts(
            engine.tokenizer, load_prompts(args.workload, args.num_prompts), chat=True
        )
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        engine.add_request("warm-up", prompts[0], SamplingParams(max_tokens=4))
        while engine.has_unfinished_requests():
            engine.step()
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), ids, params)
        started: set[str] = set()
        while len(started) < len(prompts):  # prefill steps: not measured
            started.update(o.request_id for o in engine.step() if o.token_ids)
        totals: Counter[str] = Counter()
        num_steps = 0
        with _timers(engine, totals):
            while engine.has_unfinished_requests():
                t0 = time.perf_counter()
                engine.step()
                totals["step"] += time.perf_counter() - t0
                num_steps += 1
    ms = {k: 1e3 * v / max(num_steps, 1) for k, v in totals.items()}
    inner = ms.get("linear", 0) + ms.get("attention", 0) + ms.get("norm_rope_silu", 0)
    ms["forward_rest"] = ms.get("forward", 0) - inner - ms.get("lm_head", 0)
    ms["host"] = ms["step"] - ms.get("forward", 0)
    ms["num_steps"] = num_steps
    return ms


@contextmanager
def _timers(engine, totals: Counter) -> Iterator[None]:
    """Time the calls that make up a forward; restores every patched attribute."""
    import engine.models.layers as layers
    import engine.models.llama as llama
    from engine.models.quant import QuantizedLinear
    from engine.models.weights import PackedLinear

    model = engine.runner.model
    patches: list[tuple[object, str, object]] = []

    def patch(owner: object, name: str, label: str) -> None:
        own = name in vars(owner)  # else an instance attribute shadows the class's
        patches.append((owner, name, getattr(owner, name) if own else None))
        setattr(owner, name, _timed(getattr(owner, name), label, totals))

    for module in model.model.modules():  # every Linear but the LM head
        if isinstance(module, (PackedLinear, QuantizedLinear)) or type(module).__name__ == "Linear":
            patch(module, "forward", "linear")
    patch(model, "compute_logits", "lm_head")
    backend = model.model.layers[0].self_attn.attn_backend
    patch(backend, "forward", "attention")
    patch(layers.RMSNorm, "forward", "norm_rope_silu")
    patch(layers.RopeBatch, "__call__", "norm_rope_silu")
    patch(llama, "silu_and_mul", "norm_rope_silu")
    patch(engine.runner, "execute", "forward")
    try:
        yield
    finally:
        for owner, name, original in reversed(patches):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _timed(fn: Callable, label: str, totals: Counter) -> Callable:
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - t0

    return wrapper


def _print(args: argparse.Namespace, results: dict[str, dict[str, float]]) -> None:
    ours, base = results["kernels"], results["torch ops"]
    print(
        f"\ndecode steps of {args.num_prompts} requests ({args.workload}, {args.dtype}, "
        f"weights {args.quantization}, "
        f"{int(ours['num_steps'])} steps): ms per step"
    )
    print(f"{'component':<16}{'kernels':>10}{'torch ops':>12}{'torch/kernels':>15}")
    print("-" * 53)
    for name in (*COMPONENTS, "step"):
        a, b = ours.get(name, 0.0), base.get(name, 0.0)
        ratio = f"{b / a:.2f}x" if a > 0.05 else "-"
        print(f"{name:<16}{a:>10.2f}{b:>12.2f}{ratio:>15}")
    print(
        f"\ndecode throughput: {1e3 * args.num_prompts / ours['step']:.1f} tok/s with kernels, "
        f"{1e3 * args.num_prompts / base['step']:.1f} with torch ops "
        f"({base['step'] / ours['step']:.2f}x)"
    )
    fused = results.get("one-call decoder")
    if fused is not None:
        print(
            f"one-call decoder (bf16 layers in one kernel call): step {fused['step']:.2f} ms, "
            f"{1e3 * args.num_prompts / fused['step']:.1f} tok/s "
            f"({ours['step'] / fused['step']:.2f}x the layer-by-layer kernels)"
        )
