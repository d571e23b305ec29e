"""Micro-benchmark: the block manager's share of one speculative decoding step.

    python -m engine.benchmarks.blocks [--num-requests 256] [--num-lookahead 4] [--json]

Each step, like the scheduler: finished requests are freed; new ones arrive (prompts of
a few hundred tokens sharing system-prompt prefixes: prefix lookup + prefill
allocation); every running request gets allocate_slots(1 new token + k lookahead);
after verification, rollback() releases the rejected drafts (accepted count uniform in
0..k). Only the block manager calls are timed; the simulated model work is not.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass, field

from block_manager.kv_cache_manager import KVCacheManager

NUM_SYSTEM_PROMPTS = 8
SYSTEM_PROMPT_LEN = (64, 256)
SUFFIX_LEN = (32, 256)
OUTPUT_LEN = (32, 512)


@dataclass(slots=True)
class BenchRequest:
    request_id: str
    all_token_ids: list[int]
    max_tokens: int
    num_computed_tokens: int = 0
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.all_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return len(self.all_token_ids) - self.num_prompt_tokens >= self.max_tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=256, help="running requests")
    parser.add_argument("--num-lookahead", type=int, default=4, help="draft slots per step")
    parser.add_argument("--steps", type=int, default=1000, help="measured steps")
    parser.add_argument("--warmup-steps", type=int, default=200, help="unmeasured steps")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--num-blocks", type=int, default=None, help="default: never full")
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds the synthetic requests and acceptances"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _check_args(args: argparse.Namespace) -> None:
    for name in ("num_requests", "steps", "block_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_lookahead < 0 or args.warmup_steps < 0:
        raise ValueError("--num-lookahead and --warmup-steps must be >= 0")


class Workload:
    """Keeps num_requests running; times every block manager call of each step."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.rng = random.Random(args.seed)
        self.k = args.num_lookahead
        self.num_requests = args.num_requests
        max_len = SYSTEM_PROMPT_LEN[1] + SUFFIX_LEN[1] + OUTPUT_LEN[1] + 2 * (self.k + 1)
        num_blocks = args.num_blocks or args.num_requests * (-(-max_len // args.block_size)) + 1
        self.manager = KVCacheManager(num_blocks, args.block_size, cache_key="bench")
        self.system_prompts = [
            [self.rng.randrange(32000) for _ in range(self.rng.randint(*SYSTEM_PROMPT_LEN))]
            for _ in range(NUM_SYSTEM_PROMPTS)
        ]
        self.running: list[BenchRequest] = []
        self.num_arrived = 0
        self.num_ops = 0
        self.num_failed_allocations = 0

    def new_request(self) -> BenchRequest:
        rng = self.rng
        suffix = [rng.randrange(32000) for _ in range(rng.randint(*SUFFIX_LEN))]
        prompt = rng.choice(self.system_prompts) + suffix
        self.num_arrived += 1
        return BenchRequest(f"req-{self.num_arrived}", prompt, rng.randint(*OUTPUT_LEN))

    def step(self) -> tuple[float, float]:
        """One scheduler step; returns the (wall, CPU) seconds spent in the block manager.

        CPU time (this thread's) excludes time the OS gave to other processes: on a
        shared machine it is the steadier figure.
        """
        manager, k, rng = self.manager, self.k, self.rng
        finished = [r for r in self.running if r.is_finished]
        self.running = [r for r in self.running if not r.is_finished]
        arrivals = [self.new_request() for _ in range(self.num_requests - len(self.running))]
        decoding = self.running
        accepted = [rng.randint(0, k) for _ in decoding]
        drafts = [rng.randrange(32000) for _ in range(k)]

        c0, t0 = time.thread_time(), time.perf_counter()
        for request in finished:
            manager.free(request)
        for request in arrivals:
            hit_ids, num_cached = manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_cached
            if manager.allocate_slots(request, num_new, 0, hit_ids) is None:
                self.num_failed_allocations += 1
        for request in decoding:
            if manager.allocate_slots(request, 1, k) is None:
                self.num_failed_allocations += 1
        t1, c1 = time.perf_counter(), time.thread_time()

        # Model work (not timed): prefill samples one token; verification appends the
        # accepted drafts plus one recovered/bonus token.
        for request in arrivals:
            request.num_computed_tokens = request.num_tokens
            request.all_token_ids.append(7)
        for request, num_accepted in zip(decoding, accepted, strict=True):
            request.all_token_ids += drafts[:num_accepted]
            request.all_token_ids.append(7)

        c2, t2 = time.thread_time(), time.perf_counter()
        for request, num_accepted in zip(decoding, accepted, strict=True):
            request.num_computed_tokens = manager.rollback(
                request, request.num_computed_tokens + 1 + num_accepted
            )
        t3, c3 = time.perf_counter(), time.thread_time()
        self.num_ops += len(finished) + 2 * len(arrivals) + 2 * len(decoding)
        self.running = decoding + arrivals
        return (t1 - t0) + (t3 - t2), (c1 - c0) + (c3 - c2)


def _p99(sorted_values: list[float]) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(0.99 * len(sorted_values)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.benchmarks.blocks", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        parser.error(str(exc))


def run(args: argparse.Namespace) -> int:
    """`specserve bench blocks` and `python -m engine.benchmarks.blocks`."""
    _check_args(args)
    workload = Workload(args)
    for _ in range(args.warmup_steps):
        workload.step()
    workload.num_ops = 0
    manager = workload.manager
    query0, hit0 = manager.num_prefix_query_tokens, manager.num_prefix_hit_tokens
    wall_s, cpu_s = zip(*(workload.step() for _ in range(args.steps)), strict=True)
    step_ms, cpu_ms = sorted(1e3 * t for t in wall_s), sorted(1e3 * t for t in cpu_s)
    total_s = sum(wall_s)
    manager.check_integrity()
    result = {
        "num_requests": args.num_requests,
        "num_lookahead": args.num_lookahead,
        "block_size": args.block_size,
        "steps": args.steps,
        "step_ms_mean": statistics.fmean(step_ms),
        "step_ms_p50": step_ms[len(step_ms) // 2],
        "step_ms_p99": _p99(step_ms),
        "step_cpu_ms_mean": statistics.fmean(cpu_ms),
        "step_cpu_ms_p99": _p99(cpu_ms),
        "ops_per_s": workload.num_ops / total_s if total_s else 0.0,
        "prefix_hit_rate": (manager.num_prefix_hit_tokens - hit0)
        / max(1, manager.num_prefix_query_tokens - query0),
        "usage": manager.usage,
        "num_blocks": manager.num_blocks,
        "failed_allocations": workload.num_failed_allocations,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.num_requests} requests, k={args.num_lookahead}, block_size "
            f"{args.block_size}, {args.steps} steps ({args.warmup_steps} warm-up)\n"
            f"block manager per step: mean {result['step_ms_mean']:.3f} ms, "
            f"p50 {result['step_ms_p50']:.3f} ms, p99 {result['step_ms_p99']:.3f} ms (wall); "
            f"mean {result['step_cpu_ms_mean']:.3f} ms, p99 {result['step_cpu_ms_p99']:.3f} ms "
            "(thread CPU)\n"
            f"operations/s: {result['ops_per_s']:,.0f}; prefix hit rate "
            f"{result['prefix_hit_rate']:.1%}; usage {result['usage']:.1%} of "
            f"{result['num_blocks']} blocks; failed allocations "
            f"{result['failed_allocations']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
