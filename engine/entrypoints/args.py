"""The engine flags shared by every subcommand that builds an engine (generate, serve,
bench offline, bench acceptance), and their translation into an EngineConfig."""

from __future__ import annotations

import argparse
from dataclasses import fields

from engine.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    SPECULATIVE_METHODS,
    EngineConfig,
)

# The engine's defaults, from EngineConfig itself: flags never restate them.
_ENGINE_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}

# Where _EngineFlag records the engine flags given on the command line.
GIVEN_ENGINE_FLAGS = "given_engine_flags"


class _EngineFlag(argparse.Action):
    """Stores a value (with nargs=0: ``const``) and records the flag as given, so that
    `generate --server` can refuse engine flags, which only a local engine reads."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        given = getattr(namespace, GIVEN_ENGINE_FLAGS, ())
        setattr(namespace, GIVEN_ENGINE_FLAGS, (*given, self.option_strings[0]))


def add_engine_args(parser: argparse.ArgumentParser, *, with_seed: bool = True) -> None:
    """Every EngineConfig field as a flag; shared by generate, serve and bench.
    `specserve generate` uses --seed for its request, so it leaves the engine's out."""
    d = _ENGINE_DEFAULTS
    parser.set_defaults(**{GIVEN_ENGINE_FLAGS: ()})
    g = parser.add_argument_group("engine")

    def flag(name: str, help_text: str, **kwargs) -> None:
        dest = name.removeprefix("--").replace("-", "_")
        kwargs.setdefault("default", d.get(dest))
        if kwargs.get("type") is int:
            kwargs.setdefault("metavar", "N")
        g.add_argument(name, action=_EngineFlag, help=help_text, **kwargs)

    flag("--model", "HF directory, .gguf file or hub id (default: smollm2-135m-instruct)")
    flag(
        "--tokenizer",
        "directory holding the tokenizer files (tokenizer.json, tokenizer_config.json ...) "
        "for a --model without them (default: the model's own)",
    )
    flag("--draft-model", "small draft model sharing the tokenizer")
    flag(
        "--speculative-method",
        "default: draft if --draft-model is given, else ngram; suffix: token trees from "
        "suffix decoding over the request's text and recent answers; ngram-tree: "
        "n-gram lookup's last matches as a tree; eagle-tree: the EAGLE draft's dynamic "
        "token trees",
        choices=SPECULATIVE_METHODS,
    )
    flag(
        "--num-speculative-tokens",
        "the most draft tokens a request verifies per step",
        type=int,
    )
    flag(
        "--spec-tree-max-nodes",
        "token trees (suffix, ngram-tree, eagle-tree): the most nodes one request verifies "
        "in a step (1-63; the proposer keeps the nodes that pay at the measured cost of a "
        "verified token)",
        type=int,
    )
    flag(
        "--suffix-cache-mib",
        "suffix decoding: memory for the cache of recent answers it proposes from, one "
        "cache per API key (0: each request's own prompt and output only)",
        type=float,
        metavar="MIB",
    )
    flag(
        "--speculative-disable-batch-size",
        "above this many running requests nobody speculates (default: 4 on CPU, 16 on CUDA)",
        type=int,
    )
    flag(
        "--no-speculation-gate",
        "speculate wherever adaptive k's cost model says it pays, even where the engine "
        "measures its speculating steps slower than plain ones",
        nargs=0,
        const=True,
        default=False,
    )
    flag("--block-size", "tokens per KV cache block: 8, 16, 32 or 64", type=int)
    flag(
        "--num-kv-blocks",
        "KV cache blocks (default: as many as --kv-cache-memory-gib holds)",
        type=int,
    )
    flag(
        "--kv-cache-memory-gib",
        "memory for all KV caches, target and draft, when --num-kv-blocks is not given",
        type=float,
        metavar="GIB",
    )
    flag("--max-num-seqs", "the most requests running at once", type=int)
    flag("--max-num-batched-tokens", "the most tokens one engine step computes", type=int)
    flag(
        "--max-model-len",
        "the most tokens (prompt + output) per request (default: the model's context length)",
        type=int,
    )
    flag(
        "--max-waiting-requests",
        "the most requests waiting to run; further ones are refused",
        type=int,
    )
    flag(
        "--no-prefix-caching",
        "do not reuse the KV cache of shared prompt prefixes",
        nargs=0,
        const=True,
        default=False,
    )
    flag("--device", "auto, cpu, cuda or cuda:N")
    flag(
        "--dtype",
        "auto: bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16, AMX, Arm BF16), "
        "else float32; float32 for exact parity with transformers fp32",
        choices=DTYPES,
    )
    flag(
        "--kv-cache-dtype",
        "auto: the KV cache in the model's dtype; bfloat16: K/V stored as bf16 under a "
        "float32 model, half the KV memory and the bytes attention reads (outputs differ "
        "slightly from float32's; speculation stays lossless; a draft keeps its own dtype)",
        choices=KV_CACHE_DTYPES,
    )
    flag(
        "--attn-backend",
        "auto: xformers on CUDA when installed, the compiled kernels (cpu) on CPU in float32 "
        "or bfloat16 when they build, else torch",
        choices=ATTENTION_BACKENDS,
    )
    flag(
        "--quantization",
        "auto: a .gguf's Q4_0/Q4_1/Q8_0 weights served as stored on the CPU kernels, other "
        "models as they are; none: dequantized (exact parity with transformers); int8: every "
        "Linear weight of any model quantized to 8 bits at load (CPU)",
        choices=QUANTIZATIONS,
    )
    flag(
        "--no-batch-invariance",
        "let a row's bits depend on how many rows share its kernel call, for speed: on CPUs "
        "with AMX-BF16, quantized Linear layers of 16 rows or more (32 for Q8_0) on bf16 "
        "tiles (faster prompts and crowded steps; greedy speculation then not token-"
        "identical to plain decoding)",
        nargs=0,
        const=True,
        default=False,
    )
    flag(
        "--structured-output-step-budget-ms",
        "the most CPU time one request's constraint (its grammar matcher) may take in one "
        "engine step; a request over it ends with an error naming the constraint (a spike "
        "over it after a step under a tenth of it, within ten times it, is forgiven once "
        "in 64 steps)",
        type=float,
        metavar="MS",
    )
    flag(
        "--structured-output-max-items",
        "llguidance's cap on the parser items of one mask computation (step_max_items); a "
        "constraint over it ends its request with an error",
        type=int,
    )
    flag("--num-threads", "torch CPU threads (default: one per core)", type=int)
    if with_seed:
        flag("--seed", "engine seed for unseeded requests", type=int)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        draft_model=args.draft_model,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_disable_batch_size=args.speculative_disable_batch_size,
        speculation_gate=not args.no_speculation_gate,
        spec_tree_max_nodes=args.spec_tree_max_nodes,
        suffix_cache_mib=args.suffix_cache_mib,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gib=args.kv_cache_memory_gib,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_waiting_requests=args.max_waiting_requests,
        enable_prefix_caching=not args.no_prefix_caching,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        attn_backend=args.attn_backend,
        quantization=args.quantization,
        batch_invariant=not args.no_batch_invariance,
        seed=getattr(args, "seed", _ENGINE_DEFAULTS["seed"]),
        structured_output_step_budget_ms=args.structured_output_step_budget_ms,
        structured_output_max_items=args.structured_output_max_items,
        num_threads=args.num_threads,
    )
