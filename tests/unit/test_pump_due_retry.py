"""A row this relay put in back-off is sent again when its retry is due, also while a
backlog keeps the pipeline busy. Only a rewind sends a due row, and its key's later rows
wait for it (tests/integration/test_backoff_order.py); the pump rewound only once nothing
was in flight, so during a backlog the key waited for the whole backlog. It now stops
claiming at the retry time and rewinds once what is in flight is settled. Pure logic:
the pump over the fakes, a publisher whose reports come a turn late."""

from __future__ import annotations

from typing import Any

from relay.metrics import RelayMetrics
from relay.model import OutboxRow, RowId
from relay.publisher import Outcome
from relay.pump import Pump
from tests.unit.pump_fakes import Clock, FailingPublisher, Leases, Log, RetryStore, row

TURN_S = 0.01


class LaggingPublisher(FailingPublisher):
    """Reports a row at the second poll after it was sent: batches stay in flight across
    the pump's turns, as they do while a backlog keeps the pipeline full."""

    def __init__(self, clock: Clock, outcomes: dict[int, list[Outcome]]) -> None:
        super().__init__(clock, outcomes)
        self.polls = 0
        self.sent_poll: dict[RowId, int] = {}

    def send(self, r: OutboxRow, on_delivery: Any) -> Outcome | None:
        self.sent_poll[r.id] = self.polls
        return super().send(r, on_delivery)

    def poll(self, timeout_s: float) -> int:
        self.polls += 1
        later = [(r, cb) for r, cb in self.queued if self.polls - self.sent_poll[r.id] < 2]
        self.queued = [(r, cb) for r, cb in self.queued if (r, cb) not in later]
        served = super().poll(timeout_s)
        self.queued = later
        return served


def pump_with(store: RetryStore, publisher: FailingPublisher, clock: Clock) -> Pump:
    return Pump(store=store, publisher=publisher, leases=Leases(), nshards=2,  # type: ignore[arg-type]
                batch_size=10, pipeline_depth=4, max_attempts=3, backoff_initial_s=0.1,
                backoff_max_s=1.0, metrics=RelayMetrics(), log=Log(), clock=clock,
                claim_interval_s=0.0, claim_interval_max_s=0.0)


def turn_until(pump: Pump, clock: Clock, done: Any, *, limit: int, message: str) -> None:
    """Turns of the pump, TURN_S of the clock each, until ``done()``; at most ``limit``."""
    for _ in range(limit):
        if done():
            return
        pump.run_once()
        clock.advance(TURN_S)
    assert done(), message


def test_a_due_retry_is_sent_while_a_backlog_keeps_the_pipeline_busy() -> None:
    clock = Clock()
    rejected = Outcome(ok=False, error_class="record_too_large", message="rejected", permanent=True)
    store = RetryStore([row(1, 0, key="k")] + [row(i, 1) for i in range(3, 3003)], clock)
    publisher = LaggingPublisher(clock, {1: [rejected]})
    pump = pump_with(store, publisher, clock)
    turn_until(pump, clock, lambda: store.failures, limit=400, message="row 1 never refused")
    [(_, attempts, _, due)] = store.failures  # row 1 refused: in back-off
    assert attempts == 1
    store.add(row(2, 0, key="k"))  # a later row of its key: waits for it
    turn_until(pump, clock, lambda: len([i for i, _ in publisher.sent_at if i == 1]) == 2, limit=400,
               message="row 1 not sent again")
    again = [at for i, at in publisher.sent_at if i == 1][1]
    assert again - due <= 5 * TURN_S, f"sent {again - due:.2f} s after its retry time"
    assert sum(1 for r in store.pending.values() if r.shard == 1) > 1000  # the backlog goes on
    turn_until(pump, clock, lambda: RowId(2) in store.marked, limit=400, message="row 2 not marked")
    order = [i for i, _ in publisher.sent_at if i in (1, 2)]
    assert order == [1, 1, 2]  # the key's order kept
    assert pump.totals.order_violations == 0


def test_a_retry_scheduled_before_this_relay_started_is_sent_at_its_time() -> None:
    """A row another replica put in back-off (or this relay before a restart): the rewind
    reads when it is due, so it is sent then, not at the next periodic pass (10 s)."""
    clock = Clock()
    store = RetryStore([row(1, 0, key="k")], clock)
    store.not_before[RowId(1)] = clock() + 2.0  # scheduled elsewhere, due in 2 s
    publisher = FailingPublisher(clock)
    pump = pump_with(store, publisher, clock)
    due = clock() + 2.0
    # 6 s: the periodic pass (10 s) is not what sends it.
    turn_until(pump, clock, lambda: publisher.sent_at, limit=600, message="not sent at its retry time")
    [(sent, at)] = publisher.sent_at
    assert sent == 1 and due <= at <= due + 2 * TURN_S
