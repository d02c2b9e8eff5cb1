"""A lease's deadline is checked while a batch is produced: a shard whose lease may be gone
gets nothing more, even in the middle of a batch.  The clock is read for every row only
while some lease is near its deadline (LEASE_NEAR_S); otherwise once every
LEASE_LOOK_ROWS rows (issue 18's thirteenth pass: a clock read per row was 3 % of the
relay's CPU in a drain).  Pure logic: the real Pump over fakes, a clock that moves on
every read."""

from __future__ import annotations

from relay.metrics import RelayMetrics
from relay.model import Lease, ShardId, Token
from relay.pump import LEASE_LOOK_ROWS, LEASE_NEAR_S, Pump
from tests.unit.pump_fakes import Leases, Log, Publisher, Store, row


class TickingClock:
    """Every read moves time on by ``step`` seconds; counts the reads."""

    def __init__(self, step: float) -> None:
        self.t, self.step, self.reads = 1000.0, step, 0

    def __call__(self) -> float:
        self.reads += 1
        self.t += self.step
        return self.t


def produce_one_batch(rows: int, deadlines: dict[int, float], clock: TickingClock) -> tuple[Publisher, Pump]:
    store = Store([row(i, i % 2) for i in range(1, rows + 1)])
    leases = Leases()
    leases.leases = {ShardId(s): Lease(ShardId(s), Token(1), d) for s, d in deadlines.items()}
    publisher = Publisher()
    pump = Pump(store=store, publisher=publisher, leases=leases, nshards=2,  # type: ignore[arg-type]
                batch_size=rows, pipeline_depth=4, max_attempts=3, backoff_initial_s=0.1,
                backoff_max_s=1.0, metrics=RelayMetrics(), log=Log(), clock=clock)
    pump.run_once()
    return publisher, pump


def test_a_lease_running_out_mid_batch_stops_its_shard_there() -> None:
    clock = TickingClock(step=0.001)  # a millisecond a read: 100 rows of this batch take ~0.1 s
    deadline = 1000.0 + LEASE_NEAR_S / 20  # near from the start: shard 1's lease ends after ~50 reads
    publisher, pump = produce_one_batch(400, {0: 1e12, 1: deadline}, clock)
    sent_1 = [i for i in publisher.sent if i % 2 == 1]
    sent_0 = [i for i in publisher.sent if i % 2 == 0]
    assert sent_0 == list(range(2, 401, 2))  # the other shard's lease holds: every row
    assert 0 < len(sent_1) < 200  # produced until its deadline, then nothing
    assert sent_1 == list(range(1, 2 * len(sent_1), 2))  # a prefix: nothing after a gap
    assert pump.rewind_requested  # the rest is claimed again (under a renewed lease)


def test_far_deadlines_cost_a_clock_read_every_few_hundred_rows() -> None:
    clock = TickingClock(step=0.0)
    rows = 4 * LEASE_LOOK_ROWS
    publisher, _pump = produce_one_batch(rows, {0: 1e12, 1: 1e12}, clock)
    assert len(publisher.sent) == rows
    assert clock.reads < rows // 4  # per row it was one read each, and more


def test_a_batch_that_runs_long_still_sees_a_deadline_come_near() -> None:
    """Far at the start, the deadline comes near while the batch is produced (a slow
    interpreter, a paused process): the look every LEASE_LOOK_ROWS rows finds it."""
    clock = TickingClock(step=0.0)

    class SlowPublisher(Publisher):
        def send(self, r, on_delivery):  # type: ignore[no-untyped-def]
            clock.t += 0.002  # every row takes 2 ms: 2,048 rows take 4 s
            return super().send(r, on_delivery)

    rows = 8 * LEASE_LOOK_ROWS
    store = Store([row(i, i % 2) for i in range(1, rows + 1)])
    leases = Leases()
    deadline = 1000.0 + LEASE_NEAR_S + 0.5  # far at first; near after ~250 rows, past after ~750
    leases.leases = {ShardId(0): Lease(ShardId(0), Token(1), 1e12), ShardId(1): Lease(ShardId(1), Token(1), deadline)}
    publisher = SlowPublisher()
    pump = Pump(store=store, publisher=publisher, leases=leases, nshards=2,  # type: ignore[arg-type]
                batch_size=rows, pipeline_depth=4, max_attempts=3, backoff_initial_s=0.1,
                backoff_max_s=1.0, metrics=RelayMetrics(), log=Log(), clock=clock)
    pump.run_once()
    sent_1 = [i for i in publisher.sent if i % 2 == 1]
    assert 300 < len(sent_1) < 450, len(sent_1)  # up to the deadline (~row 750 of 2,048), give or take the look
    assert sent_1 == list(range(1, 2 * len(sent_1), 2))
    assert len([i for i in publisher.sent if i % 2 == 0]) == rows // 2
