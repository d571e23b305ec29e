"""Random schedules of allocate / verify / rollback / preempt / free across many
requests, against a model of what each KV slot holds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from block_manager import KVCacheManager
from tests.block_manager.fakes import FakeRequest

BS = 4  # small blocks: boundaries are hit often
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9], [5] * 12, []]


class Simulation:
    """Drives one manager like the scheduler does and tracks KV content per slot."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.running: dict[str, FakeRequest] = {}
        self.waiting: list[FakeRequest] = []
        self.kv: dict[int, list[int | None]] = {}  # block_id -> token in each slot

    def protected(self, request: FakeRequest) -> set[int]:
        """Blocks of the request that nobody may write: shared or in the prefix cache."""
        blocks = self.manager.pool.blocks
        return {
            block_id
            for block_id in self.manager.get_block_ids(request.request_id)
            if blocks[block_id].ref_cnt > 1 or blocks[block_id].block_hash is not None
        }

    def write(
        self, request: FakeRequest, start: int, token_ids: list[int], protected: set[int]
    ) -> None:
        block_ids = self.manager.get_block_ids(request.request_id)
        for pos, token in enumerate(token_ids, start):
            block_id = block_ids[pos // BS]
            assert block_id not in protected, f"write into shared/cached block {block_id}"
            self.kv.setdefault(block_id, [None] * BS)[pos % BS] = token

    def admit(self, request: FakeRequest, num_lookahead: int) -> None:
        hit_ids, num_cached = self.manager.get_computed_blocks(request)
        num_new = request.num_tokens - num_cached
        if self.manager.allocate_slots(request, num_new, num_lookahead, hit_ids) is None:
            self.manager.free(request)  # drops lookup state; holds no blocks
            self.waiting.append(request)
            return
        self.write(request, num_cached, request.all_token_ids[num_cached:], set(hit_ids))
        request.num_computed_tokens = request.num_tokens
        request.all_token_ids.append(77)  # the sampled token
        self.running[request.request_id] = request

    def spec_step(self, request: FakeRequest, drafts: list[int], num_accepted: int) -> None:
        num_new = request.num_tokens - request.num_computed_tokens
        start = request.num_computed_tokens
        protected = self.protected(request)
        if self.manager.allocate_slots(request, num_new, len(drafts)) is None:
            return
        self.write(request, start, request.all_token_ids[start:] + drafts, protected)
        accepted = drafts[:num_accepted]
        request.all_token_ids += accepted + [88]  # accepted drafts + recovered/bonus
        kept = self.manager.rollback(request, start + num_new + num_accepted)
        request.num_computed_tokens = kept

    def check_kv(self) -> None:
        """Every computed slot of every running request holds that request's token."""
        for request in self.running.values():
            block_ids = self.manager.get_block_ids(request.request_id)
            for pos in range(request.num_computed_tokens):
                slot_token = self.kv[block_ids[pos // BS]][pos % BS]
                assert slot_token == request.all_token_ids[pos], (request, pos)


op = st.one_of(
    st.tuples(st.just("arrive"), st.integers(0, 3), st.lists(st.integers(0, 3), max_size=9)),
    st.tuples(st.just("step"), st.lists(st.integers(0, 3), max_size=5), st.integers(0, 5)),
    st.tuples(st.just("rollback"), st.floats(0, 1)),
    st.tuples(st.just("preempt"), st.integers(0, 99)),
    st.tuples(st.just("finish"), st.integers(0, 99)),
    st.tuples(st.just("retry"), st.integers(0, 3)),
    st.tuples(st.just("reset"), st.none()),
)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(st.tuples(op, st.integers(0, 99)), min_size=20, max_size=80),
    enable_caching=st.booleans(),
    num_blocks=st.integers(4, 24),
)
def test_random_schedules_keep_invariants(ops, enable_caching: bool, num_blocks: int) -> None:
    manager = KVCacheManager(num_blocks, block_size=BS, enable_caching=enable_caching)
    sim = Simulation(manager)
    for i, ((kind, *args), pick) in enumerate(ops):
        running = list(sim.running.values())
        target = running[pick % len(running)] if running else None
        if kind == "arrive":
            tokens = PREFIXES[args[0]] + args[1] + [i + 100]
            sim.admit(FakeRequest(f"r{i}", tokens), num_lookahead=pick % 3)
        elif kind == "retry" and sim.waiting:
            sim.admit(sim.waiting.pop(0), num_lookahead=args[0])
        elif kind == "step" and target is not None:
            sim.spec_step(target, [d + 10 for d in args[0]], min(args[1], len(args[0])))
        elif kind == "rollback" and target is not None:
            num_tokens = int(args[0] * target.num_computed_tokens)
            kept = manager.rollback(target, num_tokens)
            assert kept <= num_tokens and num_tokens - kept < BS
            target.num_computed_tokens = kept
        elif kind in ("preempt", "finish") and target is not None:
            manager.free(target)
            manager.free(target)  # double free is a no-op
            del sim.running[target.request_id]
            if kind == "preempt":
                target.num_computed_tokens = 0
                sim.waiting.append(target)
        elif kind == "reset":
            manager.reset_prefix_cache()
        manager.check_integrity()
        sim.check_kv()
    for request in list(sim.running.values()):
        manager.free(request)
    manager.check_integrity()
    assert manager.usage == 0
    assert manager.num_free_blocks == manager.num_blocks
