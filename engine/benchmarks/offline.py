"""`specserve bench offline`: the engine against transformers on one workload.

Every system gets the same prompts and the same number of output tokens (EOS is
ignored so the work is equal); the table prints each one's throughput and latency and
its ratio to the first specserve run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from dataclasses import asdict, replace

from engine.benchmarks import bounds, external
from engine.benchmarks.report import RequestTiming, RunResult, format_table, summarize
from engine.benchmarks.workloads import json_schemas, load_prompts, valid_share
from engine.entrypoints.args import add_engine_args, engine_config_from_args
from scheduler.spec_length import expected_tokens_per_step

BASELINES = ("generate", "generate_batch", "assisted", "vllm", "llamacpp", "llamacpp-lookup")


def add_workload_args(parser: argparse.ArgumentParser, num_prompts: int) -> None:
    """The prompt set and its size: shared by the offline benchmarks."""
    parser.add_argument(
        "--workload",
        default="chat",
        help="chat, grounded, json (extraction: a JSON schema per request), repeated (one "
        "extraction template over many inputs, then earlier prompts again), or a JSONL file "
        "with a 'prompt' field",
    )
    parser.add_argument(
        "--num-prompts", type=int, default=num_prompts, help="requests in the workload"
    )
    parser.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    parser.add_argument(
        "--no-chat-template", action="store_true", help="tokenize prompts as plain text"
    )


SPEC_MODES = (
    "none", "ngram", "ngram-tree", "suffix", "draft", "hybrid", "eagle", "eagle-tree", "auto"
)  # fmt: skip
NO_GATE = "-nogate"  # a mode's run without the speculation gate (scheduler/spec_gate.py)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, num_prompts=32)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="requests in flight at once (default: all prompts)",
    )
    parser.add_argument(
        "--spec-modes",
        default=None,
        help=f"comma list of {','.join(SPEC_MODES)}: one specserve run each "
        "(default: none plus the configured method, if any); a mode with -nogate "
        "(eagle-nogate) runs without the speculation gate; draft and hybrid use "
        "--draft-model, or the default model's shipped draft; eagle and auto use "
        "--eagle-draft, or the default model's shipped EAGLE draft",
    )
    parser.add_argument(
        "--eagle-draft",
        default=None,
        help="the EAGLE draft (specserve train-draft --method eagle) of --spec-modes eagle "
        "and auto",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of the specserve runs (above 0: with --baselines none)",
    )
    parser.add_argument(
        "--baselines",
        default="generate,generate_batch",
        help=f"comma list from {','.join(BASELINES)}, or 'none'",
    )
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    external.add_arguments(parser)
    add_engine_args(parser)


def run(args: argparse.Namespace) -> int:
    from engine.core.llm_engine import LLMEngine
    from engine.loader import load_model

    if args.num_prompts < 1 or args.output_len < 1:
        raise ValueError("--num-prompts and --output-len must be >= 1")
    if not 0.0 <= args.temperature <= 2.0:
        raise ValueError(f"--temperature must be in [0, 2], got {args.temperature}")
    if args.temperature > 0 and args.baselines != "none":
        raise ValueError("--temperature above 0 compares specserve runs only: add --baselines none")
    concurrency = args.concurrency or args.num_prompts
    external.preflight(args, concurrency)
    base_config = engine_config_from_args(args)
    _log(f"loading {base_config.model or 'the default model'}...")
    loaded = load_model(
        base_config.model,
        dtype=base_config.dtype,
        device=base_config.device,
        attn_backend=base_config.attn_backend,
        tokenizer=base_config.tokenizer,
        quantization=base_config.quantization,
    )
    prompts = tokenize_prompts(
        loaded.tokenizer, load_prompts(args.workload, args.num_prompts), not args.no_chat_template
    )
    results: list[RunResult] = []
    schemas = json_schemas(len(prompts)) if args.workload == "json" else None
    for mode in _spec_modes(args, base_config):
        mode, gate = mode.removesuffix(NO_GATE), not mode.endswith(NO_GATE)
        label = mode if gate else mode + NO_GATE
        draft = None
        if mode in ("draft", "hybrid"):
            draft = replace(base_config, speculative_method=mode).resolved_draft_model
        elif mode in ("eagle", "eagle-tree", "auto"):
            draft = (
                args.eagle_draft
                or replace(
                    base_config, speculative_method=mode, draft_model=None
                ).resolved_draft_model
            )
        config = replace(
            base_config,
            speculative_method=mode,
            draft_model=draft,
            speculation_gate=gate and base_config.speculation_gate,
        )
        engine = LLMEngine(config, loaded=loaded)
        warm_up(engine, prompts, concurrency, args.output_len, loaded.device.type == "cuda")
        if schemas:
            _compile_schemas(engine, schemas)
        # The json workload runs each mode with its schemas, then free: the same prompts,
        # each to the length its constrained answer had, so both runs make the same tokens;
        # with concurrency, then half and half (what constrained requests cost the others).
        lengths = None
        for part in _json_parts(schemas, concurrency):
            name = f"{label}, {part}" if part != "free" else label
            bar = _bar(len(prompts), f"specserve spec={name}", args.no_progress)
            result = _run_engine(
                engine,
                prompts,
                args.output_len,
                concurrency,
                bar,
                f"specserve (spec: {name})",
                args.temperature,
                _json_part(schemas, part),
                lengths,
            )  # fmt: skip
            lengths = lengths or result.spec.pop("output_lens", None)
            result.spec.pop("output_lens", None)
            results.append(result)
            _close(bar)
    results += _run_baselines(args, loaded, prompts, concurrency)
    machine = bounds.measure() if loaded.device.type == "cpu" else None
    _print_report(args, concurrency, results, machine)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_json(args, concurrency, results, machine), f, indent=2)
    return 0


def warm_up(engine, prompts, concurrency: int, output_len: int, every_prompt: bool) -> None:
    """One full batch, so the timed runs find the KV cache's pages touched. With
    ``every_prompt`` (on a GPU) every prompt is also prefilled once, two tokens each, and
    the prefix cache emptied after: a GPU loads kernels and picks library algorithms at
    the first call of each new shape, which once cost the first mode of an invocation up
    to 0.9 s of TTFT that the modes after it did not pay (docs/benchmarks.md, "On an
    NVIDIA H200")."""
    _run_engine(engine, prompts[:concurrency], min(output_len, 8), concurrency, None)
    if every_prompt:
        _run_engine(engine, prompts, 2, concurrency, None)
        engine.kv_manager.reset_prefix_cache()


def _spec_modes(args, config) -> list[str]:
    if args.spec_modes:
        modes = [m.strip() for m in args.spec_modes.split(",") if m.strip()]
        bad = [m for m in modes if m.removesuffix(NO_GATE) not in SPEC_MODES]
        if bad:
            raise ValueError(f"--spec-modes must be from {', '.join(SPEC_MODES)}; got {bad}")
        return modes
    method = config.speculative_method or "none"
    return ["none"] if method == "none" else ["none", method]


def tokenize_prompts(tokenizer, prompts: list[str], chat: bool) -> list[list[int]]:
    """Token ids of each prompt, wrapped as a user turn in the chat template if asked."""
    if not chat or tokenizer.chat_template is None:
        return [list(tokenizer.encode(p)) for p in prompts]
    out = []
    for p in prompts:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        out.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return out


def _run_engine(
    engine, prompts, output_len, concurrency, bar, name="specserve", temperature=0.0,
    schemas=None, output_lens=None,
) -> RunResult:  # fmt: skip
    """``schemas``: a JSON schema per prompt, its request's structured_output (a
    constrained request ends when its answer is complete; the result then counts the
    answers that parse and validate, and keeps each one's length in
    ``spec["output_lens"]``); None for a request leaves it free, and the result then
    has the free requests' mean TPOT. ``output_lens``: each request's own max_tokens."""
    from engine.io.sampling_params import SamplingParams, StructuredOutput

    params = [
        SamplingParams(
            max_tokens=output_lens[i] if output_lens else output_len,
            temperature=temperature,
            ignore_eos=True,
            structured_output=(
                StructuredOutput(json_schema=schemas[i]) if schemas and schemas[i] else None
            ),
        )
        for i in range(len(prompts) if schemas or output_lens else 1)
    ]
    engine.kv_manager.reset_prefix_cache()  # no run reuses the prefill of the one before
    pending = deque(enumerate(prompts))
    timings: dict[str, RequestTiming] = {}
    texts: dict[str, list[str]] = {}
    in_flight = 0
    overhead, steps = 0.0, []
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            i, ids = pending.popleft()
            timings[f"b{i}"] = RequestTiming(time.perf_counter())
            engine.add_request(f"b{i}", ids, params[i % len(params)])
            in_flight += 1
        outputs = engine.step()
        now = time.perf_counter()
        step = engine.last_step
        if step is not None:
            steps.append(step)
            overhead += step.timings.host_overhead_s
        for out in outputs:
            t = timings[out.request_id]
            if out.token_ids and t.first_token is None:
                t.first_token = now
            t.num_tokens += len(out.token_ids)
            texts.setdefault(out.request_id, []).append(out.text)
            if out.finished:
                t.end = now
                in_flight -= 1
                if bar is not None:
                    bar.update(1)
    result = summarize(name, time.perf_counter() - start, list(timings.values()))
    if schemas:
        held = [i for i, schema in enumerate(schemas) if schema]
        answers = ["".join(texts.get(f"b{i}", [])) for i in held]
        result.spec["valid_json"] = valid_share(answers, [schemas[i] for i in held])
        result.spec["output_lens"] = [timings[f"b{i}"].num_tokens for i in range(len(prompts))]
        free = [timings[f"b{i}"].tpot for i, schema in enumerate(schemas) if not schema]
        free = [t for t in free if t is not None]
        if free:
            result.spec["free_tpot_ms"] = 1e3 * sum(free) / len(free)
    result.spec.update(spec_stats(steps))
    result.step_overhead_ms = 1e3 * overhead / max(len(steps), 1)
    return result


def _json_parts(schemas, concurrency: int) -> list[str]:
    if not schemas:
        return ["free"]
    return ["json schema", "free"] + (["half json schema"] if concurrency > 1 else [])


def _json_part(schemas, part: str) -> list[dict | None] | None:
    """Each request's schema in one part of the json workload (None: free)."""
    if part == "free":
        return None
    if part == "half json schema":  # every other request
        return [s if i % 2 == 0 else None for i, s in enumerate(schemas)]
    return schemas


def _compile_schemas(engine, schemas: list[dict]) -> None:
    """Compile the workload's schemas before the timed runs (a service sees the same
    schemas again and again; the engine's cache keeps 128), and say what that took."""
    from engine.io.sampling_params import StructuredOutput

    start = time.perf_counter()
    engine.grammars.grammar(StructuredOutput(json_schema={"type": "object"}))  # the tokenizer
    made = time.perf_counter()
    distinct = {json.dumps(s, sort_keys=True): s for s in schemas}
    for schema in distinct.values():
        engine.grammars.grammar(StructuredOutput(json_schema=schema))
    done = time.perf_counter()
    print(
        f"grammar: tokenizer view {1e3 * (made - start):.0f} ms (once per engine), "
        f"{len(distinct)} schemas compiled in {1e3 * (done - made):.1f} ms (untimed)",
        file=sys.stderr,
    )


def spec_stats(steps) -> dict[str, float]:
    drafts = [d for s in steps for d in s.drafts_per_verification]
    accepted = [a for s in steps for a in s.accepted_per_verification]
    if not drafts:
        return {}
    rejections = sum(1 for d, a in zip(drafts, accepted) if a < d)
    rate = sum(accepted) / max(sum(accepted) + rejections, 1)  # per-token acceptance a
    return {
        "num_verifications": len(drafts),
        "num_draft_tokens": sum(drafts),
        "num_accepted_tokens": sum(accepted),
        "acceptance_rate": sum(accepted) / sum(drafts),
        "per_token_acceptance": rate,
        "mean_k": sum(drafts) / len(drafts),
        "tokens_per_verification": sum(a + 1 for a in accepted) / len(accepted),
        "acceptance_by_position": acceptance_by_position(drafts, accepted),
        "expected_tokens_per_verification": sum(expected_tokens_per_step(rate, d) for d in drafts)
        / len(drafts),
    }


def acceptance_by_position(drafts: list[int], accepted: list[int]) -> list[float]:
    """For each draft position j (1-based), the share of drafts at j that were accepted,
    among verifications that proposed j drafts or more and accepted all before j."""
    rates = []
    for j in range(1, max(drafts, default=0) + 1):
        reached = [a for d, a in zip(drafts, accepted) if d >= j and a >= j - 1]
        if not reached:
            break
        rates.append(sum(1 for a in reached if a >= j) / len(reached))
    return rates


def _run_baselines(args, loaded, prompts, concurrency) -> list[RunResult]:
    from engine.benchmarks import hf_baselines as hf

    names = [] if args.baselines == "none" else [b.strip() for b in args.baselines.split(",")]
    bad = [b for b in names if b not in BASELINES]
    if bad:
        raise ValueError(f"--baselines must be from {', '.join(BASELINES)} or 'none'; got {bad}")
    results, model = [], None
    for name in names:
        if name in external.NAMES:
            results.append(external.run(args, name, loaded, prompts, concurrency))
            continue
        if model is None:
            if loaded.float_weights_dir() is None:
                raise ValueError("baselines need the model's HF directory; this model has none")
            model = hf.load_hf_model(loaded.float_weights_dir(), str(loaded.device), loaded.dtype)
        pad_id = loaded.tokenizer.pad_token_id or 0
        bar = _bar(len(prompts), f"hf {name}", args.no_progress)
        if name == "generate":
            hf.run_generate(model, prompts[:1], 4, 1, pad_id)  # warm-up
            results.append(
                hf.run_generate(model, prompts, args.output_len, concurrency, pad_id, bar)
            )
        elif name == "generate_batch":
            results.append(hf.run_generate_batch(model, prompts, args.output_len, bar))
        else:
            results.append(
                hf.run_generate(
                    model,
                    prompts,
                    args.output_len,
                    1,
                    pad_id,
                    bar,
                    assistant_lookup=args.num_speculative_tokens,
                )
            )
        _close(bar)
    return results


def _print_report(args, concurrency, results: list[RunResult], machine=None) -> None:
    print(
        f"\nworkload {args.workload}: {args.num_prompts} prompts x {args.output_len} tokens, "
        f"concurrency {concurrency}, "
        f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}, "
        f"dtype {args.dtype}"
        + (f", KV cache {kv}" if (kv := getattr(args, "kv_cache_dtype", "auto")) != "auto" else "")
    )
    if machine is not None:
        print(machine.line())
    print(format_table(results, reference=results[0]))
    specserve = [r for r in results if r.system.startswith("specserve")]
    baselines = [r for r in results if not r.system.startswith("specserve")]
    for r in specserve:
        if "valid_json" in r.spec:
            print(f"{r.system}: answers that parse and validate {100 * r.spec['valid_json']:.0f}%")
        if "free_tpot_ms" in r.spec:
            print(f"{r.system}: the free requests' TPOT {r.spec['free_tpot_ms']:.2f} ms")
        if "acceptance_rate" in r.spec:
            s = r.spec
            print(
                f"{r.system}: acceptance {s['acceptance_rate']:.2f} (per token "
                f"{s['per_token_acceptance']:.2f}), mean k {s['mean_k']:.2f}, tokens/verification "
                f"{s['tokens_per_verification']:.2f} (expected "
                f"{s['expected_tokens_per_verification']:.2f}); by draft position "
                + " ".join(f"{x:.2f}" for x in s["acceptance_by_position"])
            )
        print(f"{r.system}: scheduling + batch building per step {r.step_overhead_ms:.2f} ms")
    if specserve and baselines:
        best = max(baselines, key=lambda r: r.output_tokens_per_s)
        for r in specserve:
            print(
                f"{r.system} vs best baseline ({best.system}): "
                f"{r.output_tokens_per_s / best.output_tokens_per_s:.2f}x"
            )
    if len(specserve) > 1:
        for r in specserve[1:]:
            print(
                f"{r.system} vs {specserve[0].system}: "
                f"{r.output_tokens_per_s / specserve[0].output_tokens_per_s:.2f}x"
            )


def _json(args, concurrency, results, machine=None) -> dict:
    return {
        "bounds": asdict(machine) if machine is not None else None,
        "workload": args.workload,
        "num_prompts": args.num_prompts,
        "output_len": args.output_len,
        "concurrency": concurrency,
        "results": [r.to_dict() for r in results],
    }


def _bar(total: int, desc: str, disabled: bool):
    if disabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False)


def _close(bar) -> None:
    if bar is not None:
        bar.close()


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
