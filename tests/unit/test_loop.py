"""The loop owner (relay/loop.py) with a fake clock: when it claims, waits, sleeps and wakes,
and the failure, retry, dead-letter and fencing paths of the pump it drives.

Pure logic: the real Loop and Pump over the fakes of tests/unit/pump_fakes.py; time
moves only when the loop waits (on the fake wake-up adapter).
"""

from __future__ import annotations

import pytest

from relay.loop import AWAKE_PAUSE_MAX_S, BUSY_POLL_BASE_S, Loop
from relay.metrics import RelayMetrics
from relay.model import ShardId
from relay.publisher import Outcome
from relay.pump import Pump
from tests.unit.pump_fakes import (
    Clock,
    FailingPublisher,
    LosingLeases,
    RetryStore,
    Wakeup,
    row,
)
from tests.unit.pump_fakes import Log as FakeLog

POLL_S = 1.0


class Relay:
    """The loop with its pump, as relay/app.py composes them (leases and backlog aside:
    ``heartbeat_s`` stands for the next due time the supervisor passes)."""

    def __init__(self, rows: list[object] | None = None, *, outcomes: dict[int, list[Outcome]] | None = None,
                 max_attempts: int = 3, dead_letter_topic: str | None = None,
                 heartbeat_s: float = 60.0, grant: bool = True, peer: bool = False,
                 claim_interval_s: float = 0.0, claim_interval_max_s: float = 0.0) -> None:
        self.clock = Clock()
        self.store = RetryStore(rows or [], self.clock)  # type: ignore[arg-type]
        self.publisher = FailingPublisher(self.clock, outcomes)
        self.leases = LosingLeases()
        self.wakeup = Wakeup(self.clock, grant=grant, peer=peer)
        self.heartbeat_s = heartbeat_s
        self.pump = Pump(store=self.store, publisher=self.publisher, leases=self.leases,  # type: ignore[arg-type]
                         nshards=2, batch_size=10, pipeline_depth=2, max_attempts=max_attempts,
                         backoff_initial_s=0.1, backoff_max_s=1.0, metrics=RelayMetrics(),
                         log=FakeLog(), clock=self.clock, dead_letter_topic=dead_letter_topic,
                         claim_interval_s=claim_interval_s, claim_interval_max_s=claim_interval_max_s)
        self.wakes: list[str] = []  # what on_wake heard
        self.loop = Loop(pump=self.pump, wakeup=self.wakeup, leases=self.leases,  # type: ignore[arg-type]
                         poll_interval_s=POLL_S, on_wake=self.wakes.append, clock=self.clock)
        self.pump.start()
        self.turns = 0

    def turn(self) -> None:
        now = self.clock()
        self.loop.run_once(now)
        self.loop.wait(now, wake_by=now + self.heartbeat_s)
        self.turns += 1

    def turn_until(self, done: object, *, limit: int = 2000) -> None:
        for _ in range(limit):
            if done():  # type: ignore[operator]
                return
            self.turn()
        raise AssertionError(f"not done after {limit} turns at t={self.clock() - 1000.0:.3f}")


def test_an_idle_relay_sleeps_at_its_first_empty_claim_after_one_more_claim() -> None:
    r = Relay()
    r.turn_until(lambda: r.wakeup.sleeping)
    # Its first claim found nothing (the fake store is empty): it took the wake-up lock at
    # once, without waiting.  Until issue 18's twenty-ninth pass it polled on its own first,
    # 10 ms doubling up to the poll interval, and a lone row waited up to 640 ms for it.
    assert r.store.claims == 1
    assert r.wakeup.pauses + r.wakeup.waits == []
    assert r.wakeup.sleeps == 1
    r.turn()  # one more claim: a commit may have raced the lock
    assert r.store.claims == 2
    assert r.wakeup.waits == pytest.approx([POLL_S])  # then it waits on LISTEN


def test_a_caught_up_relay_stays_awake_while_its_claims_find_rows() -> None:
    # Claims paced as the relay's defaults pace them, and a row for each: no claim finds
    # nothing, so it never sleeps and writers never notify.
    r = Relay(claim_interval_s=0.005, claim_interval_max_s=0.08)
    for n in range(1, 30):
        r.store.add(row(n, n % 2))
        r.turn_until(lambda n=n: len(r.store.marked) == n)
    assert r.wakeup.sleeps == 0 and r.wakes == []  # rows found awake are no wake-up
    assert all(wait <= AWAKE_PAUSE_MAX_S for wait in r.wakeup.pauses)


def test_a_notification_wakes_the_sleeping_relay_at_once() -> None:
    r = Relay(heartbeat_s=0.3)
    r.turn_until(lambda: r.wakeup.sleeping)
    r.turn()  # the claim after taking the lock, then a heartbeat's wait: mid-interval now
    assert r.loop.next_poll - r.clock() == pytest.approx(POLL_S - 0.3)
    asleep_at = r.clock()
    r.store.add(row(1, 0))
    r.wakeup.notify()
    r.turn_until(lambda: r.store.marked == [1])
    # Marked within a busy poll (10 ms), not at the next poll 0.7 s away: the notification woke it.
    assert r.clock() - asleep_at <= 2 * BUSY_POLL_BASE_S + 1e-9
    assert r.wakes == ["notify"]  # it found rows: awake (writers stop notifying), asleep again after


def test_a_notification_inside_a_paced_claims_wait_is_claimed_when_the_wait_ends() -> None:
    # Claims paced as the relay's defaults pace them: asleep, every claim that finds nothing
    # (the one after taking the lock, each poll's) puts the next one up to 80 ms away.  A
    # notification inside that wait used to be spent on a turn that could not claim, and
    # its rows waited for the next poll (0.92 s here, in a test that failed before the fix).
    r = Relay(heartbeat_s=0.3, claim_interval_s=0.005, claim_interval_max_s=0.08)
    r.turn_until(lambda: r.wakeup.sleeping)
    now = r.clock()
    r.loop.run_once(now)  # the claim after taking the lock: it found nothing, the next one is paced
    assert r.pump.claim_not_before > r.clock()
    written = r.clock()
    r.store.add(row(1, 0))
    r.wakeup.notify()  # a writer commits before the loop waits
    r.loop.wait(now, wake_by=now + r.heartbeat_s)
    r.turn_until(lambda: r.store.marked == [1])
    assert r.publisher.sent_at[0][1] - written <= 0.08 + 1e-6
    assert r.wakes == ["notify"]


def test_rows_no_notification_announced_wake_it_at_the_poll_and_say_so() -> None:
    r = Relay(heartbeat_s=0.3)
    r.turn_until(lambda: r.wakeup.sleeping)
    r.turn()
    r.store.add(row(1, 0))  # written without a notification (the trigger dropped, say)
    r.turn_until(lambda: r.store.marked == [1])
    assert r.wakes == ["poll"]
    # Asleep again, a notification is the next one.
    r.turn_until(lambda: r.wakeup.sleeping)
    r.turn()
    r.store.add(row(2, 0))
    r.wakeup.notify()
    r.turn_until(lambda: r.store.marked == [1, 2])
    assert r.wakes == ["poll", "notify"]


def test_asleep_it_claims_once_per_poll_interval_not_at_every_heartbeat() -> None:
    r = Relay(heartbeat_s=0.25)  # the supervisor's due times come four times per interval
    r.turn_until(lambda: r.wakeup.sleeping)
    r.turn()
    start, claims, turns = r.clock(), r.store.claims, r.turns
    r.turn_until(lambda: r.clock() - start >= 10 * POLL_S)
    assert r.turns - turns >= 40
    assert 9 <= r.store.claims - claims <= 11
    # A row whose notification was lost is claimed within one poll interval.
    r.store.add(row(1, 0))
    written = r.clock()
    r.turn_until(lambda: r.publisher.sent_at)
    assert r.publisher.sent_at[0][1] - written <= POLL_S + 1e-6


def test_asleep_and_paced_it_wakes_once_per_poll_interval() -> None:
    """Asleep, a turn claims at the poll or after a notification, and a notification ends the
    wait by itself.  The poll's claim set the pace (the next claim not before ~80 ms), and
    the wait ended there too: a second turn each poll interval that did nothing, half of an
    idle relay's wake-ups (1.2 % of a core on this project's machines, with leases' and
    gauges' turns)."""
    r = Relay(claim_interval_s=0.005, claim_interval_max_s=0.08)
    r.turn_until(lambda: r.wakeup.sleeping)
    r.turn()
    start, claims, turns = r.clock(), r.store.claims, r.turns
    r.turn_until(lambda: r.clock() - start >= 10 * POLL_S)
    assert 9 <= r.store.claims - claims <= 11
    assert r.turns - turns <= 11, r.turns - turns
    # Still: a row whose notification was lost is claimed within one poll interval, and a
    # notification is claimed at once.
    r.store.add(row(1, 0))
    written = r.clock()
    r.turn_until(lambda: r.publisher.sent_at)
    assert r.publisher.sent_at[0][1] - written <= POLL_S + 1e-6


def test_a_sleep_refused_keeps_polling_at_the_poll_interval() -> None:
    r = Relay(grant=False)  # writers mid-transaction, or a peer already sleeps
    r.turn_until(lambda: r.clock() >= 1010.0)
    assert not r.wakeup.sleeping
    assert max(r.wakeup.waits) == pytest.approx(POLL_S)


def test_beside_a_sleeping_peer_an_idle_relay_claims_once_per_poll_interval() -> None:
    # Paced as the relay's defaults pace claims.  A peer holds the wake-up lock, so writers
    # notify this relay too: it waits on LISTEN until the poll, where it claimed (and tried
    # the lock) every 80 ms, its pace; 12.4 claims a second against one (two real relays
    # idle side by side, 2026-12-05), and this test failed before the fix.
    r = Relay(grant=False, peer=True, claim_interval_s=0.005, claim_interval_max_s=0.08)
    r.turn_until(lambda: r.clock() >= 1002.0)
    claims, start = r.store.claims, r.clock()
    r.turn_until(lambda: r.clock() - start >= 10 * POLL_S)
    assert 9 <= r.store.claims - claims <= 11
    # A writer's commit is claimed on its notification, not at the next poll.
    r.store.add(row(1, 0))
    r.wakeup.notify()
    written = r.clock()
    r.turn_until(lambda: r.publisher.sent_at)
    assert r.publisher.sent_at[0][1] - written <= 0.08 + 1e-6


def test_refused_by_writers_mid_transaction_it_claims_again_at_its_pace() -> None:
    # Nobody sleeps, so nobody is notified: the rows those writers commit are claimed
    # within the pace (80 ms), not at the poll.
    r = Relay(grant=False, peer=False, claim_interval_s=0.005, claim_interval_max_s=0.08)
    r.turn_until(lambda: r.clock() >= 1002.0)
    r.store.add(row(1, 0))
    written = r.clock()
    r.turn_until(lambda: r.publisher.sent_at)
    assert r.publisher.sent_at[0][1] - written <= 0.08 + 1e-6


def test_transient_failures_back_off_and_the_row_goes_once_when_due() -> None:
    timeout = Outcome(ok=False, error_class="timeout", message="broker timed out")
    r = Relay([row(1, 0)], outcomes={1: [timeout, timeout, timeout]})
    due: list[float] = []
    for _ in range(500):
        before = r.pump.claim_not_before
        r.turn()
        if r.pump.claim_not_before != before:
            due.append(r.pump.claim_not_before)
        if r.store.marked:
            break
    assert r.store.marked == [1]
    sends = [at for _, at in r.publisher.sent_at]
    assert len(sends) == 4 and len(due) == 3
    for failed_at, retry_at, next_send in zip(sends[:-1], due, sends[1:], strict=True):
        assert retry_at > failed_at  # a back-off, however long the formula makes it
        assert next_send >= retry_at  # never claimed again before it is over
        assert next_send - retry_at < 1e-6  # and not a poll interval after it either
    assert r.store.failures == []  # transient: no attempt counted against the row


def test_a_failing_row_is_retried_after_its_back_off_then_dead_lettered() -> None:
    rejected = Outcome(ok=False, error_class="record_too_large", message="rejected",
                       permanent=True)
    r = Relay([row(1, 0), row(2, 1)], outcomes={1: [rejected] * 5}, max_attempts=3,
              dead_letter_topic="orders.dlq")
    r.turn_until(lambda: r.store.dead)
    r.turn_until(lambda: not r.pump.busy())
    assert [(i, n) for i, n, _, _ in r.store.failures] == [(1, 1), (1, 2)]
    assert r.store.dead == [(1, "record_too_large")]
    assert r.publisher.dead_letters == [(1, "orders.dlq", "record_too_large")]
    assert r.store.marked == [2]  # the other shard's row went at once
    sends = [at for i, at in r.publisher.sent_at if i == 1]
    assert len(sends) == 3
    for (_, _, failed_at, until), again in zip(r.store.failures, sends[1:], strict=True):
        assert until > failed_at  # a back-off was asked for
        assert again >= until  # and the retry came after it
        assert again - until <= POLL_S + 1e-6  # within a poll interval of it
    assert r.pump.totals.dead_lettered == 1 and r.pump.totals.failed == 3


def test_a_mark_that_returns_fewer_shards_loses_their_leases_and_their_rows_stay_pending() -> None:
    r = Relay([row(1, 0), row(2, 1), row(3, 0), row(4, 1)])
    r.store.fenced = {ShardId(1)}  # another replica took shard 1 over meanwhile
    r.turn_until(lambda: r.leases.lost)
    r.turn_until(lambda: not r.pump.busy())
    assert r.leases.lost == [({ShardId(1)}, "mark_fenced")]
    assert r.store.marked == [1, 3]
    assert set(r.store.pending) == {2, 4}  # the new owner publishes them
    assert r.pump.totals.fenced == 2
    sent = len(r.publisher.sent_at)
    r.store.add(row(5, 1))
    r.wakeup.notify()
    for _ in range(20):
        r.turn()
    assert len(r.publisher.sent_at) == sent  # nothing more from the lost shard


def test_a_fenced_dead_letter_loses_the_lease() -> None:
    rejected = Outcome(ok=False, error_class="record_too_large", message="rejected", permanent=True)
    r = Relay([row(1, 0), row(2, 1)], outcomes={1: [rejected], 2: [rejected]}, max_attempts=1)
    r.store.fenced = {ShardId(0)}
    r.turn_until(lambda: r.leases.lost and r.store.dead)
    # Shard 0's move is fenced: its lease is lost, the row stays; shard 1's is moved.
    assert r.leases.lost == [({ShardId(0)}, "dead_letter_fenced")]
    assert r.store.dead == [(2, "record_too_large")]
    assert 1 in r.store.pending and r.pump.totals.fenced == 1


def test_a_fenced_failure_record_loses_the_lease() -> None:
    rejected = Outcome(ok=False, error_class="record_too_large", message="rejected", permanent=True)
    r = Relay([row(1, 0)], outcomes={1: [rejected]}, max_attempts=3)
    r.store.fenced = {ShardId(0)}
    r.turn_until(lambda: r.leases.lost)
    assert r.leases.lost == [({ShardId(0)}, "record_failure_fenced")]
    assert r.store.failures == [] and r.store.dead == []
    assert 1 in r.store.pending


def test_losing_the_database_rewinds_and_drops_the_wake_up_lock() -> None:
    r = Relay([row(1, 0)])
    r.turn_until(lambda: r.wakeup.sleeping)
    assert not r.pump.rewind_requested
    r.loop.database_lost()
    assert r.pump.rewind_requested and not r.wakeup.sleeping and r.wakeup.closed == 1


def awake_after_the_last_row(*, paced: bool) -> tuple[float, int]:
    """Seconds from the last row's mark to the wake-up lock, and the claims between."""
    r = Relay()
    if paced:
        r.pump.claim_interval_s = r.pump.pace_s = 0.005
        r.pump.claim_interval_max_s = 0.05
    r.store.add(row(1, 0))
    r.turn_until(lambda: r.store.marked == [1])
    marked_at, claims = r.clock(), r.store.claims
    r.turn_until(lambda: r.wakeup.sleeping)
    return r.clock() - marked_at, r.store.claims - claims


def test_paced_turns_are_not_claims_that_found_nothing() -> None:
    """The relay sleeps at its first claim that finds nothing.  A turn that claims nothing
    because the next claim is paced is not one (when such turns counted, a paced relay went
    to sleep after 0.2 s of the 1.3 s it then polled on its own): paced, it sleeps at the
    first claim after its pace, at most claim_interval_max_s after its last row."""
    for paced in (False, True):
        seconds, claims = awake_after_the_last_row(paced=paced)
        assert claims <= 1 and seconds <= 0.05 + 1e-9, (paced, seconds, claims)


def test_a_paced_trickle_costs_one_turn_of_the_loop_per_claim() -> None:
    """Rows arriving steadily, a few per paced claim.  The turn after a claim found its
    next claim not due, so the loop ran three turns per claim: the claim, one whose wait
    settled the claim's reports and mark, and one that claimed nothing before waiting
    for the claim's due time (about 0.9 ms of the relay's CPU per claim at 1,000 events/s,
    measured).  The wait now goes on to that due time."""
    r = Relay()
    r.pump.claim_interval_s = r.pump.pace_s = 0.005
    r.pump.claim_interval_max_s = 0.05
    next_id, arrival = 1, r.clock()
    while next_id <= 300:
        while arrival <= r.clock() and next_id <= 300:  # one row a millisecond
            r.store.add(row(next_id, next_id % 2))
            next_id, arrival = next_id + 1, arrival + 0.001
        r.turn()
    r.turn_until(lambda: len(r.store.marked) == 300)
    claims = r.pump.totals.claims
    assert 20 <= claims <= 150  # paced: several rows a claim
    assert r.turns <= claims + 5, f"{r.turns} turns for {claims} claims"
    assert r.store.marked == list(range(1, 301))
    # Awake between paced claims: it waits without reading the LISTEN socket.
    assert r.wakeup.pauses and not r.wakeup.waits
