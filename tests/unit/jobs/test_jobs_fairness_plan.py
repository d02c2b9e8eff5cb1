"""Pure logic of the jobs package: the fair plan, round-robin memory, back-off, retry verdicts,
admission math, configuration checks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from consumer_sdk.errors import PermanentError
from consumer_sdk.jobs import AdmissionPolicy, Backoff, InvalidJob, LeaseLost, WaitFor, WorkerConfig
from consumer_sdk.jobs.fairness import Limits, RoundRobin, after_round, plan
from consumer_sdk.jobs.model import Lane, Take
from consumer_sdk.jobs.retry import describe, verdict

QUEUES = ("interactive", "bulk")


def test_interactive_work_gets_its_slot_although_bulk_has_10000_ready():
    lanes = [Lane("bulk", "big", ready=64, running=3), Lane("interactive", "small", ready=1, running=0)]
    limits = Limits(max_concurrency=4, queue_limits={"bulk": 3})
    takes = plan(lanes, queues=QUEUES, busy={"bulk": 3}, limits=limits, last_served={})
    assert [(t.queue, t.owner_id, t.n) for t in takes] == [("interactive", "small", 1)]


def test_bulk_never_takes_the_slot_kept_for_interactive():
    lanes = [Lane("bulk", "big", ready=64, running=0)]
    takes = plan(lanes, queues=QUEUES, busy={}, limits=Limits(max_concurrency=4, queue_limits={"bulk": 3}),
                 last_served={})
    assert [(t.owner_id, t.n) for t in takes] == [("big", 3)]


def test_slots_are_dealt_round_robin_between_owners():
    lanes = [Lane("bulk", "a", ready=64, running=0), Lane("bulk", "b", ready=1, running=0),
             Lane("bulk", "c", ready=64, running=0)]
    takes = plan(lanes, queues=("bulk",), busy={}, limits=Limits(max_concurrency=6), last_served={})
    assert {t.owner_id: t.n for t in takes} == {"a": 3, "b": 1, "c": 2}


def test_the_least_recently_served_owner_goes_first():
    lanes = [Lane("bulk", "a", ready=64, running=0), Lane("bulk", "b", ready=64, running=0)]
    rr = RoundRobin()
    rr.record([("bulk", "a")], now=10.0)
    takes = plan(lanes, queues=("bulk",), busy={}, limits=Limits(max_concurrency=1), last_served=rr.last_served)
    assert [t.owner_id for t in takes] == ["b"]
    rr.record([("bulk", "b")], now=11.0)
    takes = plan(lanes, queues=("bulk",), busy={}, limits=Limits(max_concurrency=1), last_served=rr.last_served)
    assert [t.owner_id for t in takes] == ["a"]


def test_owner_limits_count_running_jobs_in_every_queue():
    lanes = [Lane("interactive", "a", ready=5, running=1), Lane("bulk", "a", ready=5, running=1)]
    limits = Limits(max_concurrency=8, owner_limit=3, owner_limits={"vip": 10})
    takes = plan(lanes, queues=QUEUES, busy={}, limits=limits, last_served={})
    assert sum(t.n for t in takes) == 2 and all(t.owner_limit == 3 for t in takes)
    assert limits.for_owner("vip") == 10


def test_a_round_frees_its_completed_owners_room_and_says_when_a_held_back_owner_can_go():
    limits = Limits(max_concurrency=4, owner_limit=2)
    lanes = [Lane("bulk", "held", ready=10, running=2), Lane("bulk", "free", ready=3, running=0),
             Lane("interactive", "held", ready=1, running=2)]
    left, unblocked = after_round(lanes, [], [], {"held": 1}, limits)
    assert unblocked
    assert [(lane.queue, lane.owner_id, lane.running) for lane in left] == [
        ("bulk", "held", 1), ("bulk", "free", 0), ("interactive", "held", 1)]
    takes = plan(left, queues=QUEUES, busy={}, limits=limits, last_served={})
    assert sum(t.n for t in takes if t.owner_id == "held") == 1
    # An owner under its limit was not held back: no extra round for it.
    assert after_round(lanes, [], [], {"free": 1}, limits) == (lanes, False)
    assert after_round(lanes, [], [], {}, limits) == (lanes, False)
    # Lanes that must be read again (a claim got less than planned) stay unread, and the
    # held-back owner still gets its round.
    short = [Take("bulk", "free", 2, 2)]
    assert after_round(lanes, short, [], {"held": 1}, limits) == ([], True)


def test_round_robin_memory_is_bounded_and_forgets_the_oldest():
    rr = RoundRobin(max_lanes=2)
    rr.record([("q", "a")], 1.0)
    rr.record([("q", "b")], 2.0)
    rr.record([("q", "c")], 3.0)
    assert list(rr.last_served) == [("q", "b"), ("q", "c")]


def _consistent(lanes: list[Lane]) -> list[Lane]:
    """The database reports one running count per owner (all queues): same in each of its lanes."""
    running: dict[str, int] = {}
    return [Lane(lane.queue, lane.owner_id, lane.ready, running.setdefault(lane.owner_id, lane.running))
            for lane in lanes]


lane_lists = st.lists(
    st.builds(Lane, queue=st.sampled_from(QUEUES), owner_id=st.sampled_from("abcdef"),
              ready=st.integers(0, 20), running=st.integers(0, 5)),
    max_size=12, unique_by=lambda lane: (lane.queue, lane.owner_id)).map(_consistent)


@given(lanes=lane_lists, concurrency=st.integers(1, 10), bulk_limit=st.integers(0, 10),
       owner_limit=st.integers(1, 6), busy_bulk=st.integers(0, 10))
def test_a_plan_never_exceeds_any_limit(lanes, concurrency, bulk_limit, owner_limit, busy_bulk):
    busy = {"bulk": min(busy_bulk, concurrency)}
    limits = Limits(max_concurrency=concurrency, queue_limits={"bulk": bulk_limit}, owner_limit=owner_limit)
    takes = plan(lanes, queues=QUEUES, busy=busy, limits=limits, last_served={})
    assert sum(t.n for t in takes) <= concurrency - busy["bulk"] or not takes
    assert sum(t.n for t in takes if t.queue == "bulk") <= max(0, min(bulk_limit, concurrency) - busy["bulk"])
    by_lane = {(lane.queue, lane.owner_id): lane for lane in lanes}
    for take in takes:
        assert 0 < take.n <= by_lane[(take.queue, take.owner_id)].ready
    running = {lane.owner_id: lane.running for lane in lanes}
    for owner in {t.owner_id for t in takes}:
        assert sum(t.n for t in takes if t.owner_id == owner) + running[owner] <= owner_limit


@given(lanes=lane_lists, concurrency=st.integers(1, 10))
def test_a_plan_leaves_no_slot_idle_while_an_owner_could_take_it(lanes, concurrency):
    limits = Limits(max_concurrency=concurrency, owner_limit=4)
    takes = plan(lanes, queues=QUEUES, busy={}, limits=limits, last_served={})
    given_total = sum(t.n for t in takes)
    planned = {(t.queue, t.owner_id): t.n for t in takes}
    per_owner = {o: sum(t.n for t in takes if t.owner_id == o) for o in {t.owner_id for t in takes}}
    if given_total < concurrency:
        for lane in lanes:
            room = 4 - lane.running - per_owner.get(lane.owner_id, 0)
            assert planned.get((lane.queue, lane.owner_id), 0) >= lane.ready or room <= 0


def test_backoff_grows_exponentially_is_capped_and_jittered():
    b = Backoff(initial_s=1, max_s=10, multiplier=2, jitter=0.5)
    assert [b.ceiling_s(n) for n in (1, 2, 3, 4, 5, 6)] == [1, 2, 4, 8, 10, 10]
    assert b.delay_s(3, rand=lambda: 0.0) == 4 and b.delay_s(3, rand=lambda: 1.0) == 2
    assert Backoff(jitter=0).delay_s(1, rand=lambda: 0.7) == 1.0
    with pytest.raises(ValueError):
        Backoff(initial_s=5, max_s=1)


def test_the_verdict_comes_from_the_exception_type_and_the_attempts():
    assert verdict(PermanentError("x"), attempts=1, max_attempts=5) == "fail_permanent"
    assert verdict(ValueError("x"), attempts=1, max_attempts=5) == "retry"
    assert verdict(ValueError("x"), attempts=5, max_attempts=5) == "fail_exhausted"
    assert verdict(LeaseLost(), attempts=1, max_attempts=5) == "lost"
    assert describe(KeyError("k")) == "KeyError: 'k'"
    assert len(describe(ValueError("x" * 5000), limit=100)) == 100


def test_admission_bounds_and_retry_after():
    policy = AdmissionPolicy(capacity_per_s=2.0, horizon_s=10.0)  # bound: 20 pending
    assert not policy.refuses(19) and policy.refuses(20)
    assert policy.retry_after_s(20) == 1
    assert policy.retry_after_s(30) == 6
    assert policy.retry_after_s(10_000) == 10  # never more than the horizon
    assert policy.count_cap == 41
    with pytest.raises(ValueError):
        AdmissionPolicy(capacity_per_s=0, horizon_s=1)


def test_config_and_wait_conditions_are_checked_at_construction():
    with pytest.raises(InvalidJob):
        WorkerConfig(dsn="postgresql://x", queues=("bad queue",))
    with pytest.raises(InvalidJob):
        WorkerConfig(dsn="postgresql://x", lease_duration_s=10, heartbeat_interval_s=6)
    with pytest.raises(InvalidJob):
        WorkerConfig(dsn="postgresql://x", max_concurrency=0)
    config = WorkerConfig(dsn="postgresql://x", lease_duration_s=9)
    assert config.heartbeat_every_s == 3 and config.idle_in_transaction_ms == 9000
    with pytest.raises(ValueError):
        WaitFor(None, "nothing to wait for")
