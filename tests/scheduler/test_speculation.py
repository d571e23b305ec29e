from __future__ import annotations

import pytest

from scheduler.spec_length import (
    AcceptanceHistory,
    choose_num_spec_tokens,
    expected_tokens_per_step,
)
from tests.scheduler.helpers import fake_run, make_request, make_scheduler, step


def test_lookahead_slots_are_reserved_and_rolled_back_when_every_draft_is_rejected():
    s = make_scheduler(num_blocks=32, num_spec_tokens=4, spec_enabled=True)
    r = make_request("a", 14, max_tokens=40, max_spec_tokens=4)
    s.add_request(r)
    step(s)  # prefill: 14 tokens + 1 sampled = 15 tokens, KV for 14
    free_before = s.kv.num_free_blocks
    for _ in range(5):
        sched = step(s, num_accepted=0)
        item = sched.scheduled[0]
        assert item.num_spec_tokens == 4 and len(item.spec_token_ids) == 4
        # after rollback: KV for the verified tokens only, so the pool is back where a
        # plain decode step would leave it
        assert r.num_computed_tokens == r.num_tokens - 1
        assert len(s.kv.get_block_ids("a")) == -(-r.num_computed_tokens // 16)
    assert s.kv.num_free_blocks >= free_before - 1


def test_accepted_drafts_advance_by_k_plus_one():
    s = make_scheduler(num_spec_tokens=4, spec_enabled=True)
    r = make_request("a", 10, max_tokens=40, max_spec_tokens=3)
    s.add_request(r)
    step(s)
    before = r.num_tokens
    step(s, num_accepted=3)
    assert r.num_tokens == before + 4
    assert r.num_computed_tokens == r.num_tokens - 1
    assert (r.num_draft_tokens, r.num_accepted_tokens) == (3, 3)


def test_drafts_never_exceed_the_length_limit():
    s = make_scheduler(num_spec_tokens=4, spec_enabled=True)
    r = make_request("a", 10, max_tokens=3, max_spec_tokens=4)
    s.add_request(r)
    step(s)
    sched = step(s, num_accepted=4)
    assert sched.scheduled[0].num_spec_tokens == 1  # 2 tokens left: 1 draft + 1 bonus
    assert r.num_output_tokens == 3 and r.finish_reason == "length"


def test_speculation_switches_off_above_the_batch_size_limit():
    s = make_scheduler(num_spec_tokens=4, spec_enabled=True, spec_disable_batch_size=2)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 5, max_tokens=10, max_spec_tokens=4))
    step(s)
    sched = step(s)
    assert all(i.num_spec_tokens == 0 for i in sched.scheduled)


def test_request_can_opt_out_of_speculation():
    s = make_scheduler(num_spec_tokens=4, spec_enabled=True)
    s.add_request(make_request("a", 5, max_tokens=10, max_spec_tokens=0))
    step(s)
    assert step(s).scheduled[0].num_spec_tokens == 0


@pytest.mark.parametrize("rate", [0.0, 0.3, 0.8])
def test_expected_tokens_formula(rate):
    k = 4
    # sum over accepted-run lengths of P(run >= i)
    assert expected_tokens_per_step(rate, k) == pytest.approx(sum(rate**i for i in range(k + 1)))


def test_adaptive_k_grows_with_acceptance_and_shrinks_without():
    high, low = AcceptanceHistory(), AcceptanceHistory()
    for _ in range(10):
        high.record(4, 4)
        low.record(4, 0)
    assert choose_num_spec_tokens(high, 8, 0.05) >= 6
    assert choose_num_spec_tokens(low, 8, 0.05) == 0
    # k = 0 still probes now and then so a request can win speculation back
    ks = [choose_num_spec_tokens(low, 8, 0.05) for _ in range(20)]
    assert 1 in ks


def test_adaptive_k_is_used_when_the_request_does_not_fix_it():
    s = make_scheduler(num_spec_tokens=6, spec_enabled=True, draft_cost=0.05)
    r = make_request("a", 5, max_tokens=200)
    s.add_request(r)
    step(s)
    for _ in range(10):
        granted = step(s, num_accepted=8).scheduled[0].num_spec_tokens
    assert granted == 6
    for _ in range(15):
        granted = step(s, num_accepted=0).scheduled[0].num_spec_tokens
    assert granted <= 1


def test_each_proposer_a_request_uses_keeps_its_own_acceptance_history():
    """With a combining proposer (hybrid) the scheduler asks it which proposer drafts
    next and sizes k from that proposer's history for the request: rejections of one
    do not shorten the other's runs."""
    s = make_scheduler(num_blocks=64, num_spec_tokens=4, spec_enabled=True)
    r = make_request("a", 10, max_tokens=200)
    s.add_request(r)
    sources = iter(["good", "bad"] * 20)
    s.spec_source = lambda request: (next(sources), 0.01)
    step(s)  # prefill
    for _ in range(8):
        good = step(s, num_accepted=4)  # every draft of "good" is kept
        bad = step(s, num_accepted=0)  # every draft of "bad" is rejected
        assert good.scheduled[0].spec_source == "good" and bad.scheduled[0].spec_source == "bad"
    assert set(r.spec_histories) == {"good", "bad"}
    assert r.spec_histories["good"].rate > 0.9 and r.spec_histories["bad"].rate < 0.2
    assert good.scheduled[0].num_spec_tokens == 4
    assert bad.scheduled[0].num_spec_tokens <= 1
    assert r.spec_history.accepted == AcceptanceHistory().accepted  # the shared one unused


def test_a_forced_tail_gets_slots_past_k_within_the_length_limits_and_is_not_a_draft():
    """A constrained request's speculating step gets `forced_tail_slots` more lookahead
    slots (for the tokens its constraint forces after the drafts), never past
    max_tokens, and only when it speculates; accepted forced-tail tokens count as
    output, not as accepted drafts."""
    s = make_scheduler(num_blocks=32, num_spec_tokens=4, spec_enabled=True)
    r = make_request("a", 14, max_tokens=12, max_spec_tokens=2, forced_tail_slots=8)
    s.add_request(r)
    step(s)  # prefill: one token out
    sched = s.schedule()
    (item,) = sched.scheduled
    assert (item.num_spec_tokens, item.num_tail_slots) == (2, 8)  # 11 left: 2 + 8 + 1
    # two drafts and a forced tail of three, all accepted
    item.spec_token_ids, item.num_forced_tail = [7, 7, 7, 7, 7], 3
    item.num_scheduled_tokens += 5
    s.update(sched, fake_run(sched, num_accepted=5))
    s.kv.check_integrity()
    assert r.num_output_tokens == 7 and r.num_computed_tokens == r.num_tokens - 1
    assert (r.num_draft_tokens, r.num_accepted_tokens) == (2, 2)
    sched = s.schedule()  # 5 tokens left: 2 drafts + 2 tail + 1
    assert (sched.scheduled[0].num_spec_tokens, sched.scheduled[0].num_tail_slots) == (2, 2)
    plain = make_scheduler(num_blocks=32, num_spec_tokens=4, spec_enabled=False)
    q = make_request("b", 14, max_tokens=12, forced_tail_slots=8)
    plain.add_request(q)
    step(plain)
    assert plain.schedule().scheduled[0].num_tail_slots == 0  # no drafts, no tail
