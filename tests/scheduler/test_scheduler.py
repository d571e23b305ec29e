from __future__ import annotations

from scheduler.request import RequestStatus
from tests.scheduler.helpers import make_request, make_scheduler, step


def test_prefill_then_one_token_per_decode_step():
    s = make_scheduler()
    s.add_request(make_request("a", 20, max_tokens=3))
    out = step(s)
    assert [(i.num_scheduled_tokens, i.needs_sample) for i in out.scheduled] == [(20, True)]
    out = step(s)
    assert out.scheduled[0].num_scheduled_tokens == 1
    assert out.scheduled[0].num_computed_tokens == 20
    step(s)
    assert not s.has_unfinished_requests()
    assert s.kv.usage == 0


def test_chunked_prefill_keeps_decodes_running():
    s = make_scheduler(max_num_batched_tokens=32)
    s.add_request(make_request("short", 4, max_tokens=10))
    step(s)
    s.add_request(make_request("long", 100, max_tokens=2))
    out = step(s)
    by_id = {i.request_id: i for i in out.scheduled}
    assert by_id["short"].num_scheduled_tokens == 1  # decode first
    assert by_id["long"].num_scheduled_tokens == 31  # the rest of the budget
    assert not by_id["long"].needs_sample
    chunks = [31]
    while s.requests["long"].num_output_tokens == 0:
        out = step(s)
        chunks += [i.num_scheduled_tokens for i in out.scheduled if i.request_id == "long"]
        assert any(i.request_id == "short" for i in out.scheduled) or "short" not in s.requests
    assert sum(chunks) == 100


def test_prefix_cache_hit_skips_cached_blocks_but_not_the_last_token():
    s = make_scheduler()
    first = make_request("a", 40, max_tokens=1)
    s.add_request(first)
    step(s)  # finishes; its blocks stay cached
    twin = make_request("b", 40, max_tokens=1)
    twin.prompt_token_ids[:] = first.prompt_token_ids
    twin.all_token_ids[:] = first.prompt_token_ids
    s.add_request(twin)
    out = step(s)
    assert out.scheduled[0].num_computed_tokens == 32  # two full blocks from the cache
    assert out.scheduled[0].num_scheduled_tokens == 8
    assert twin.num_cached_prompt_tokens == 32


def test_max_num_seqs_caps_the_running_set():
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add_request(make_request(f"r{i}", 5, max_tokens=4))
    out = step(s)
    assert len(out.scheduled) == 2 and s.num_waiting == 2


def test_admission_waits_for_blocks():
    s = make_scheduler(num_blocks=5)  # 4 usable blocks = 64 slots
    s.add_request(make_request("a", 40, max_tokens=4))
    s.add_request(make_request("b", 40, max_tokens=4))
    out = step(s)
    assert [i.request_id for i in out.scheduled] == ["a"]
    assert s.num_waiting == 1


def test_preemption_by_recompute_resumes_with_its_output():
    s = make_scheduler(num_blocks=5)  # 64 slots
    s.add_request(make_request("a", 30, max_tokens=20))
    s.add_request(make_request("b", 20, max_tokens=20))
    step(s)
    b = s.requests["b"]
    for _ in range(12):  # a needs a third block at 33 tokens, b at 33 too: 64 slots run out
        step(s)
    assert s.num_preemptions >= 1
    assert b.num_preemptions >= 1
    while s.has_unfinished_requests():
        step(s)
    assert b.num_output_tokens == 20 and b.finish_reason == "length"
    assert s.kv.usage == 0


def test_priority_orders_admission_and_picks_the_preemption_victim():
    s = make_scheduler(num_blocks=5, max_num_seqs=1)
    s.add_request(make_request("low", 5, max_tokens=2, priority=5))
    s.add_request(make_request("high", 5, max_tokens=2, priority=-1))
    out = step(s)
    assert out.scheduled[0].request_id == "high"


def test_abort_frees_everything_mid_prefill_and_mid_decode():
    s = make_scheduler(max_num_batched_tokens=16)
    s.add_request(make_request("d", 5, max_tokens=50))
    step(s)
    s.add_request(make_request("p", 50, max_tokens=5))
    step(s)
    assert s.requests["p"].num_computed_tokens < 50  # still prefilling
    s.abort("p")
    s.kv.check_integrity()
    d = s.requests["d"]
    assert d.num_output_tokens >= 1
    s.abort("d")
    assert d.status is RequestStatus.FINISHED and d.finish_reason == "abort"
    assert s.kv.usage == 0 and not s.has_unfinished_requests()
    assert s.abort("unknown") is None


def test_abort_of_a_waiting_request():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("a", 5))
    s.add_request(make_request("b", 5))
    step(s)
    s.abort("b")
    assert s.num_waiting == 0
    while s.has_unfinished_requests():
        step(s)


def test_stop_token_inside_an_accepted_run_truncates_there():
    s = make_scheduler(num_spec_tokens=4, spec_enabled=True)
    r = make_request("a", 5, max_tokens=20, stop_token_ids=frozenset({7}), max_spec_tokens=3)
    s.add_request(r)
    step(s)  # prefill samples token 7 = stop
    assert r.finish_reason == "stop" and r.output_token_ids == [7]


def test_aborted_waiting_requests_leave_the_heap_at_once():
    """An idle scheduler never steps again to pop them lazily: they must go right away."""
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("running", 5, max_tokens=100))
    for i in range(50):
        s.add_request(make_request(f"w{i}", 5, priority=i % 3))
    step(s)
    for i in range(0, 50, 2):
        s.abort(f"w{i}")
    waiting_ids = [entry[3].request_id for entry in s._waiting]
    assert sorted(waiting_ids) == sorted(f"w{i}" for i in range(1, 50, 2))
    assert s.num_waiting == 25
    s.abort("running")
    for i in range(1, 50, 2):
        s.abort(f"w{i}")
    assert s._waiting == [] and s.num_waiting == 0 and not s.has_unfinished_requests()


def test_admission_order_survives_aborts_in_the_middle_of_the_heap():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("running", 5, max_tokens=2))
    for priority in [5, 1, 3, 0, 4, 2]:
        s.add_request(make_request(f"p{priority}", 5, max_tokens=2, priority=priority))
    step(s)
    s.abort("p0")
    s.abort("p3")
    admitted = []
    while s.has_unfinished_requests():
        sched = step(s)
        admitted += [i.request_id for i in sched.scheduled if i.request_id not in admitted]
    assert [r for r in admitted if r != "running"] == ["p1", "p2", "p4", "p5"]
