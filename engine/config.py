"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from engine.io.sampling_params import MAX_NUM_SPECULATIVE_TOKENS, check_int

SPECULATIVE_METHODS = (
    "none", "draft", "ngram", "ngram-tree", "suffix", "hybrid", "eagle", "eagle-tree", "auto"
)  # fmt: skip
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "xformers")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8")
KV_CACHE_DTYPES = ("auto", "bfloat16")

# The methods that run a draft model (eagle, eagle-tree: one made by train-draft
# --method eagle).
DRAFTED_METHODS = ("draft", "hybrid", "eagle", "eagle-tree")

GiB = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    # A directory with the tokenizer files, for a model directory that has none.
    tokenizer: str | None = None
    draft_model: str | None = None
    # None picks a default: "draft" when a draft model is given, else "ngram". "hybrid":
    # n-gram drafts where the context repeats, the draft model's elsewhere. "draft" and
    # "hybrid" without a draft model use the default model's shipped draft
    # (engine/drafts/), "eagle" its shipped EAGLE draft ("eagle-tree": the same draft
    # proposing dynamic token trees); "auto" is hybrid with the draft
    # there is (see resolved_speculative_method). None of them is the default: on this
    # project's CPUs n-gram lookup alone is as fast or faster (docs/benchmarks.md, "A
    # trained draft for the default model" and "EAGLE drafts").
    speculative_method: str | None = None
    num_speculative_tokens: int = 4
    # Above this many running requests nobody speculates. None: 4 on CPU (a few
    # requests already make a CPU forward compute-bound, so verified drafts stop being
    # free; measured in docs/benchmarks.md), 16 on CUDA.
    speculative_disable_batch_size: int | None = None
    # Adaptive k runs plain whole steps while the engine measures its speculating
    # decode steps slower than its plain ones, per batch size (scheduler/spec_gate.py).
    # A request's own fixed num_speculative_tokens is honoured either way.
    speculation_gate: bool = True
    ngram_min: int = 1
    ngram_max: int = 4
    # Token trees ("suffix"): the most nodes one request verifies in a step (its
    # proposer prices how many of them pay, from the measured cost of a verified token),
    # and the memory of the cache of recent answers suffix decoding proposes from,
    # one per API key (callers without a key share one).
    spec_tree_max_nodes: int = 24
    suffix_cache_mib: float = 64.0
    block_size: int = 16
    num_kv_blocks: int | None = None
    # Memory budget for all KV caches (target and draft together) when
    # num_kv_blocks is not given.
    kv_cache_memory_gib: float = 1.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    max_waiting_requests: int = 1024
    enable_prefix_caching: bool = True
    device: str = "auto"
    dtype: str = "auto"
    # The target's KV cache: "auto" the model's dtype; "bfloat16" K and V stored as bf16
    # under a float32 model (half the KV memory, half the bytes attention reads; outputs
    # differ slightly from float32's; speculation stays lossless against the target so
    # served). A draft model keeps a cache of its own dtype.
    kv_cache_dtype: str = "auto"
    attn_backend: str = "auto"
    # "auto": a .gguf's Q4_0/Q4_1/Q8_0 tensors served as stored on the CPU kernels (float
    # models as they are); "none": dequantized; "int8": every Linear weight of any model
    # made Q8_0 blocks at load. Applies to a --draft-model too.
    quantization: str = "auto"
    # False lets a kernel give a row other bits depending on how many rows share its
    # call, for speed: today the quantized Linear of 16 rows or more (32 for Q8_0) runs
    # on AMX-BF16 tiles with its weights dequantized to bf16 instead of the int8 paths
    # (on a 2-vCPU Xeon a 32-sequence decode step about 0.74x the time, a 512-token
    # prompt's prefill about 0.65x; docs/benchmarks.md). Greedy
    # speculation is then no longer token-identical to plain decoding, and a request
    # alone may differ from the same request in a crowd where tokens were near-tied.
    # Process-wide (the kernels' rule); no effect on CPUs without AMX-BF16 or on CUDA.
    batch_invariant: bool = True
    seed: int = 0
    # What one request's constraint may cost an engine step: the CPU time of its matcher
    # (a request over it ends with finish_reason "error"), and llguidance's cap on the
    # Earley items of one mask (engine/sample/grammar.py, GrammarLimits). 5 ms measured
    # better beside a hostile grammar, but a cold first mask on a loaded 2-core machine
    # passed it (docs/benchmarks.md, "A failing constraint beside free requests").
    structured_output_step_budget_ms: float = 20.0
    structured_output_max_items: int = 50_000
    # CPU threads for torch (None: torch's default, one per core). Fewer threads win
    # when other busy processes share the cores: spinning OpenMP workers then stall.
    num_threads: int | None = None

    def __post_init__(self) -> None:
        _in("speculative_method", self.speculative_method, (None, *SPECULATIVE_METHODS))
        _in("attn_backend", self.attn_backend, ATTENTION_BACKENDS)
        _in("dtype", self.dtype, DTYPES)
        _in("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _in("quantization", self.quantization, QUANTIZATIONS)
        check_int(
            "num_speculative_tokens", self.num_speculative_tokens, 1, MAX_NUM_SPECULATIVE_TOKENS
        )
        if self.speculative_disable_batch_size is not None:
            check_int(
                "speculative_disable_batch_size", self.speculative_disable_batch_size, 1, None
            )
        check_int("ngram_min", self.ngram_min, 1, 16)
        check_int("ngram_max", self.ngram_max, self.ngram_min, 16)
        check_int("spec_tree_max_nodes", self.spec_tree_max_nodes, 1, 63)
        cache = self.suffix_cache_mib
        is_number = isinstance(cache, (int, float)) and not isinstance(cache, bool)
        if not is_number or not 0 <= cache <= 65536:
            raise ValueError(f"suffix_cache_mib must be in [0, 65536], got {cache}")
        if self.block_size not in (8, 16, 32, 64):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, got {self.block_size}")
        if self.num_kv_blocks is not None:
            check_int("num_kv_blocks", self.num_kv_blocks, 2, None)
        if not self.kv_cache_memory_gib > 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        check_int("max_num_seqs", self.max_num_seqs, 1, 4096)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 16, None)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 2, None)
        check_int("max_waiting_requests", self.max_waiting_requests, 1, None)
        check_int("seed", self.seed, 0, 2**63 - 1)
        budget = self.structured_output_step_budget_ms
        if (
            isinstance(budget, bool)
            or not isinstance(budget, (int, float))
            or not 0 < budget <= 6e4
        ):
            raise ValueError(
                "structured_output_step_budget_ms must be in (0, 60000], got "
                f"{self.structured_output_step_budget_ms}"
            )
        check_int("structured_output_max_items", self.structured_output_max_items, 1000, 10**7)
        if self.num_threads is not None:
            check_int("num_threads", self.num_threads, 1, 1024)
        if self.speculative_method in DRAFTED_METHODS and not self.resolved_draft_model:
            raise ValueError(f"speculative_method={self.speculative_method!r} needs draft_model")
        undrafted = ("none", "ngram", "ngram-tree", "suffix")
        if self.draft_model and self.speculative_method in undrafted:
            raise ValueError(
                f"draft_model is set but speculative_method is {self.speculative_method!r}; "
                "use 'draft', 'hybrid', 'eagle', 'eagle-tree' or leave it unset"
            )

    @property
    def resolved_speculative_method(self) -> str:
        """The proposer the engine builds. "auto": n-gram lookup and a draft together
        (hybrid: each request gets the source with the better measured acceptance, and
        adaptive k prices each at its measured cost, k = 0 where speculation does not
        pay) when there is a draft (``draft_model``, or for the default model its
        shipped EAGLE draft), else n-gram lookup alone."""
        method = self.speculative_method
        if method is None:
            return "draft" if self.draft_model else "ngram"
        if method == "auto":
            return "hybrid" if self.resolved_draft_model else "ngram"
        return method

    @property
    def resolved_draft_model(self) -> str | None:
        """draft_model, or the default model's shipped draft when the method asks for a
        draft model and none is given."""
        if self.draft_model or self.speculative_method not in (*DRAFTED_METHODS, "auto"):
            return self.draft_model
        from engine.default_model import DEFAULT_MODEL_NAME, default_draft_path

        if self.model not in (None, DEFAULT_MODEL_NAME):
            return None
        path = default_draft_path(eagle=self.speculative_method in ("eagle", "eagle-tree", "auto"))
        return None if path is None else str(path)

    @property
    def kv_cache_memory_bytes(self) -> int:
        return int(self.kv_cache_memory_gib * GiB)


def _in(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        shown = ", ".join(repr(a) for a in allowed if a is not None)
        raise ValueError(f"{name} must be one of {shown}, got {value!r}")
