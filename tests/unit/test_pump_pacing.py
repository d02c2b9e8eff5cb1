"""Claims paced to the arrival rate (issue 18): after a claim that drained the backlog the
next one waits, longer while claims find only a few rows, shorter as they fill; a full
batch is followed at once.  While a claim is not due, ``wait`` settles delivery reports
and marks itself, so a paced claim costs one turn of the loop.  Pure logic: fakes."""

from __future__ import annotations

from relay.metrics import RelayMetrics
from relay.model import RowId
from relay.pump import PACE_STEP, PACED_CLAIM_ROWS, Pump
from tests.unit.pump_fakes import Clock, Leases, Log, Publisher, Store, row

MIN_S, MAX_S = 0.01, 0.05


def paced_pump(store: Store, publisher: Publisher, clock: Clock, batch_size: int = 100, *,
               paced: bool = True) -> Pump:
    """The pump under test, its claims paced between MIN_S and MAX_S (``paced``), or not."""
    return Pump(store=store, publisher=publisher, leases=Leases(), nshards=2,  # type: ignore[arg-type]
                batch_size=batch_size, pipeline_depth=4, max_attempts=3, backoff_initial_s=0.1,
                backoff_max_s=1.0, metrics=RelayMetrics(), log=Log(), clock=clock,
                claim_interval_s=MIN_S if paced else 0.0, claim_interval_max_s=MAX_S if paced else 0.0)


def add(store: Store, count: int) -> None:
    start = max(store.pending, default=max(store.marked, default=0)) + 1
    for i in range(start, start + count):
        store.pending[RowId(i)] = row(i, i % 2)


def test_a_trickle_stretches_the_wait_up_to_the_maximum_and_a_burst_shortens_it() -> None:
    clock, store, publisher = Clock(), Store([]), Publisher()
    pump = paced_pump(store, publisher, clock)
    waits = []
    for _ in range(8):  # one row per claim: fewer than PACED_CLAIM_ROWS
        add(store, 1)
        sent = len(publisher.sent)
        pump.run_once()
        assert len(publisher.sent) == sent + 1
        waits.append(round(pump.claim_not_before - clock(), 6))
        add(store, 1)
        pump.run_once()  # not due yet: claims nothing
        assert len(publisher.sent) == sent + 1
        clock.advance(pump.claim_not_before - clock())
        store.pending.pop(max(store.pending))  # (keep one row per claim)
    assert waits[0] == round(MIN_S * PACE_STEP, 6)
    assert waits == sorted(waits) and waits[-1] == MAX_S
    add(store, PACED_CLAIM_ROWS)  # a claim that finds enough rows shortens the wait
    pump.run_once()
    assert round(pump.claim_not_before - clock(), 6) == round(MAX_S / PACE_STEP, 6)


def test_a_full_batch_is_followed_at_once_and_resets_the_wait() -> None:
    clock, store, publisher = Clock(), Store([]), Publisher()
    pump = paced_pump(store, publisher, clock, batch_size=10)
    add(store, 1)
    pump.run_once()
    clock.advance(pump.claim_not_before - clock())
    add(store, 25)
    pump.run_once()  # a full batch of 10: the backlog is not drained
    assert len(publisher.sent) == 11
    assert pump.pace_s == MIN_S
    pump.run_once()  # at once, without the clock moving
    assert len(publisher.sent) == 21


def test_a_paced_wait_settles_reports_and_marks_without_a_turn() -> None:
    clock, store, publisher = Clock(), Store([]), Publisher()
    pump = paced_pump(store, publisher, clock)
    add(store, 3)
    pump.run_once()
    assert pump.busy() and not store.marked
    pump.wait(0.005)  # the next claim is not due: the wait acknowledges and marks
    assert sorted(store.marked) == [1, 2, 3]
    assert not pump.busy()
    assert len(publisher.sent) == 3  # and claims nothing
    result = pump.run_once()  # the next turn reports what the wait settled
    assert result.acked == 3 and result.marked == 3


def test_without_pacing_a_wait_returns_on_the_first_report() -> None:
    clock, store, publisher = Clock(), Store([]), Publisher()
    pump = paced_pump(store, publisher, clock, paced=False)
    add(store, 3)
    pump.run_once()
    pump.wait(0.005)
    assert not store.marked  # settled by the next turn, which may claim at once
    result = pump.run_once()
    assert result.acked == 3


class ReportingPublisher(Publisher):
    """A publisher that can also wait for every outstanding report in one call."""

    def __init__(self) -> None:
        super().__init__()
        self.polls = self.report_waits = 0

    def poll(self, timeout_s: float) -> int:
        self.polls += 1
        return super().poll(timeout_s)

    def wait_reports(self, timeout_s: float) -> int:
        self.report_waits += 1
        super().poll(timeout_s)
        return len(self.queued)


def test_a_paced_wait_takes_every_report_in_one_call_to_the_publisher() -> None:
    """A paced batch's rows are acknowledged one broker response per partition, and the
    wait returned to Python at each: about six polls per claim at 1,000 events/s."""
    clock, store, publisher = Clock(), Store([]), ReportingPublisher()
    pump = paced_pump(store, publisher, clock)
    add(store, 5)
    pump.run_once()
    polls = publisher.polls
    pump.wait(0.005)
    assert sorted(store.marked) == [1, 2, 3, 4, 5]
    assert publisher.report_waits == 1 and publisher.polls == polls


def test_a_claim_that_is_due_waits_for_reports_by_poll() -> None:
    """Not paced (a backlog): the wait returns on the first report, so the next claim
    is not held back by the slowest partition of the batch."""
    clock, store, publisher = Clock(), Store([]), ReportingPublisher()
    pump = paced_pump(store, publisher, clock, paced=False)
    add(store, 3)
    pump.run_once()
    pump.wait(0.005)
    assert publisher.report_waits == 0 and publisher.polls >= 2
