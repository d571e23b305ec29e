"""Drive the scheduler without a model: a fake runner that 'samples' token 7 and
accepts a fixed number of drafts."""

from __future__ import annotations

import random

from block_manager import KVCacheManager
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request
from scheduler.scheduler import Scheduler, SchedulerConfig

NEXT_TOKEN = 7


def make_scheduler(num_blocks: int = 64, **config) -> Scheduler:
    kv = KVCacheManager(num_blocks, 16, enable_caching=True)
    return Scheduler(SchedulerConfig(**config), kv)


def make_request(request_id: str, num_prompt: int, max_tokens: int = 8, **kw) -> Request:
    # Seeded by the id through random's string seeding (sha512), not hash(): str hashes
    # change with PYTHONHASHSEED, and two ids whose hashes agreed mod 50 got the same
    # prompt, shared cached blocks and broke the admission tests in 1 run of 50.
    rng = random.Random(f"prompt:{request_id}")
    prompt = [rng.randrange(10, 60) for _ in range(num_prompt)]
    return Request(request_id, prompt, max_tokens, **kw)


def fake_run(sched: SchedulerOutput, num_accepted: int = 0) -> ModelRunnerOutput:
    """Every sampling request gets `num_accepted` of its drafts plus one new token."""
    sampled, accepted = {}, {}
    for item in sched.scheduled:
        if not item.needs_sample:
            continue
        n = min(num_accepted, len(item.spec_token_ids))
        sampled[item.request_id] = item.spec_token_ids[:n] + [NEXT_TOKEN]
        accepted[item.request_id] = n
    return ModelRunnerOutput(sampled_token_ids=sampled, num_accepted=accepted)


def step(scheduler: Scheduler, num_accepted: int = 0, drafts: int | None = None):
    """One schedule/update round; drafts fill the granted lookahead slots."""
    sched = scheduler.schedule()
    for item in sched.scheduled:
        if item.num_spec_tokens:
            k = item.num_spec_tokens if drafts is None else min(drafts, item.num_spec_tokens)
            item.spec_token_ids = [NEXT_TOKEN] * k
            item.num_scheduled_tokens += k
    scheduler.update(sched, fake_run(sched, num_accepted))
    scheduler.kv.check_integrity()
    return sched
