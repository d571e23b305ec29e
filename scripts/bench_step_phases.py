"""Where a speculating step's time goes at batch 1, on the default model in bf16
(dequantized, as the draft tables in docs/benchmarks.md are measured).

    .venv/bin/python scripts/bench_step_phases.py widths --rounds 40
    .venv/bin/python scripts/bench_step_phases.py phases --method ngram --ks 0,2,4

``widths``: the target forward over 1, 2, 3 and 5 tokens of one request (a plain
decode step and verifications of 1, 2 and 4 drafts), the widths interleaved call by
call so a drifting machine moves them together; medians and the ratio to width 1.
``phases``: held-out chat prompts one at a time at a fixed k (0: no drafts), and per
decode step the time in the scheduler, the target forward, the proposer, the EAGLE
feature capture and verification.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    widths = sub.add_parser("widths")
    widths.add_argument("--rounds", type=int, default=40)
    widths.add_argument("--context", type=int, default=300)
    widths.add_argument(
        "--quantization", default="none", help="none (bf16, dequantized) or auto (as served)"
    )
    widths.add_argument("--widths", default="1,2,3,5,9,17")
    widths.add_argument(
        "--amx",
        default="auto",
        choices=("auto", "off", "both"),
        help="the quantized Linear's AMX path (where the build has one): by format, "
        "never, or both side by side",
    )
    phases = sub.add_parser("phases")
    phases.add_argument("--method", default="ngram", choices=("ngram", "eagle", "draft"))
    phases.add_argument("--ks", default="0,2,4")
    phases.add_argument("--num-prompts", type=int, default=4)
    phases.add_argument("--output-len", type=int, default=96)
    args = parser.parse_args()
    return _widths(args) if args.what == "widths" else _phases(args)


def _widths(args) -> int:
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.core.model_runner import SeqInput

    engine = LLMEngine(EngineConfig(speculative_method="none", quantization=args.quantization,
                                    dtype="bfloat16"))  # fmt: skip
    runner = engine.runner
    head = runner.model.lm_head
    head_s: dict[int, list[float]] = {}
    call = head.forward

    def timed_head(x):  # the head's share of each forward
        start = time.perf_counter()
        out = call(x)
        head_s.setdefault(x.shape[0], []).append(time.perf_counter() - start)
        return out

    head.forward = timed_head
    blocks = list(range(1, (args.context + 24) // 16 + 2))
    tokens = [100 + i % 1000 for i in range(args.context)]
    runner.forward([SeqInput(tokens, 0, blocks, 1)])  # the context, once
    from engine.kernels.quant import quant_ops

    ops = quant_ops()
    modes = {"auto": [-1], "off": [0], "both": [0, -1]}[args.amx]
    widths = [int(w) for w in args.widths.split(",")]
    times = {(mode, w): [] for mode in modes for w in widths}
    heads = {key: [] for key in times}
    for r in range(args.rounds):
        for (mode, width), seconds in times.items():
            if ops is not None:
                ops.set_amx_min_rows(mode)
            prepared = runner.prepare([SeqInput(tokens[:width], args.context, blocks, width)])
            head_s.clear()
            start = time.perf_counter()
            runner.execute(prepared)
            seconds.append(time.perf_counter() - start)
            heads[(mode, width)].append(sum(head_s.get(width, [0.0])))
        print(f"\rround {r + 1}/{args.rounds}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    if ops is not None:
        ops.set_amx_min_rows(-1)
    for mode in modes:
        label = {0: "AMX off", -1: "AMX by format"}[mode] if len(modes) > 1 else ""
        one = statistics.median(times[(mode, 1)]) if (mode, 1) in times else None
        for width in widths:
            ms = statistics.median(times[(mode, width)])
            ratio = f"  {ms / one:.3f}x" if one else ""
            head_ms = 1e3 * statistics.median(heads[(mode, width)])
            print(f"{label} forward over {width} token(s): {ms * 1e3:.2f} ms{ratio} "
                  f"(the head {head_ms:.2f} ms)".strip())  # fmt: skip
    return 0


def _phases(args) -> int:
    from engine.benchmarks.offline import tokenize_prompts
    from engine.benchmarks.workloads import load_prompts
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.io.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(speculative_method=args.method, quantization="none",
                                    dtype="bfloat16", speculation_gate=False))  # fmt: skip
    prompts = tokenize_prompts(engine.tokenizer, load_prompts("chat", args.num_prompts), True)
    spent: dict[str, float] = {}

    def timed(owner, name: str, key: str) -> None:
        call = getattr(owner, name)

        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return call(*a, **kw)
            finally:
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - start

        setattr(owner, name, wrapper)

    timed(engine.scheduler, "schedule", "schedule")
    timed(engine.runner, "execute", "target forward")
    timed(engine.proposer, "propose", "propose")
    timed(engine.verifier, "verify", "verify")
    if engine._feature_sink is not None:
        timed(engine, "_feature_sink", "features")
    ks = [int(x) for x in args.ks.split(",")]
    # per k: decode steps, their seconds, and the phases' seconds; the ks take turns
    # prompt by prompt, so a drifting machine moves them together
    runs = {k: {"steps": 0, "seconds": 0.0, "phases": {}} for k in ks}
    for i, prompt in enumerate(prompts):
        for k in ks:
            params = SamplingParams(max_tokens=args.output_len, temperature=0.0,
                                    ignore_eos=True, num_speculative_tokens=k)  # fmt: skip
            engine.add_request(f"k{k}-{i}", prompt, params)
            engine.step()  # the prefill, left out
            spent.clear()
            run = runs[k]
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()
                run["seconds"] += time.perf_counter() - start
                run["steps"] += 1
            for name, seconds in spent.items():
                run["phases"][name] = run["phases"].get(name, 0.0) + seconds
        print(f"\rprompt {i + 1}/{len(prompts)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    tokens = len(prompts) * (args.output_len - 1)
    for k, run in runs.items():
        steps = run["steps"]
        split = ", ".join(f"{name} {t / steps * 1e3:.2f}" for name, t in run["phases"].items())
        print(f"k={k}: {steps} steps, {run['seconds'] / steps * 1e3:.2f} ms a step, "
              f"{tokens / run['seconds']:.1f} tok/s; ms a step: {split}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
