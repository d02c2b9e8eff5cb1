"""Commit -> ack latencies are observed finite: a row whose created_at is +-infinity (the
schema allows it, a raw insert can write it) was observed as an infinite latency, and the
histogram's sum stayed +Inf for the life of the process, every mean latency after it NaN
(an audit with hostile rows).  A writer's clock ahead of this one still counts as 0.
Pure logic: fakes."""

from __future__ import annotations

import math

from relay.metrics import RelayMetrics
from relay.pump import Pump
from tests.unit.pump_fakes import Leases, Log, Publisher, Store, row


def test_latencies_of_infinite_created_at_are_not_observed() -> None:
    now = 1_800_000_000.0
    rows = [row(1, 0)._replace(created_epoch=-math.inf),  # created_at '-infinity'
            row(2, 1)._replace(created_epoch=math.inf),  # created_at 'infinity'
            row(3, 0)._replace(created_epoch=now + 5.0),  # a writer's clock ahead
            row(4, 1)._replace(created_epoch=now - 0.25)]
    store = Store(rows)
    metrics = RelayMetrics()
    pump = Pump(store=store, publisher=Publisher(), leases=Leases(), nshards=2,  # type: ignore[arg-type]
                batch_size=100, pipeline_depth=4, max_attempts=3, backoff_initial_s=0.1,
                backoff_max_s=1.0, metrics=metrics, log=Log(), mark_store=store, wall_clock=lambda: now)
    pump.start()
    try:
        for _ in range(5):
            pump.run_once()
            pump.wait(0.01)
        assert sorted(store.marked) == [1, 2, 3, 4]  # every row published and marked
    finally:
        pump.stop()
    registry = metrics.registry
    assert registry.get_sample_value("outbox_relay_commit_to_ack_seconds_count") == 2
    assert registry.get_sample_value("outbox_relay_commit_to_ack_seconds_sum") == 0.25
