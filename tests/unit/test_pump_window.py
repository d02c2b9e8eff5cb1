"""The redelivery window: what a crash republishes is at most ``pipeline_depth`` batches.

Rows produced and not yet marked are sent again after a SIGKILL.  The README and the
design promise at most ``pipeline_depth × batch_size`` of them, so a batch waiting for
its mark (on the mark thread) counts against the depth like one waiting for its
delivery report.  Pure logic: the store's mark waits on a gate; the other parts are fakes.
"""

from __future__ import annotations

import threading
from typing import Any

from relay.metrics import RelayMetrics
from relay.model import RowId, ShardId
from relay.pump import Pump
from tests.unit.pump_fakes import Leases, Log, Publisher, Store, row

BATCH, DEPTH = 10, 4


class HeldReports(Publisher):
    """Delivery reports come only while ``reporting`` is set."""

    reporting = True

    def poll(self, timeout_s: float) -> int:
        return super().poll(timeout_s) if self.reporting else 0


class SlowMarks(Store):
    """Marks wait until ``gate`` opens: acknowledged batches pile up behind the first."""

    def __init__(self, rows: Any) -> None:
        super().__init__(rows)
        self.gate = threading.Event()

    def mark_published(self, *, owner: str, leases: Any, rows: Any) -> tuple[set[ShardId], set[RowId]]:
        self.gate.wait(10)
        return super().mark_published(owner=owner, leases=leases, rows=rows)


def test_batches_waiting_for_their_mark_count_against_the_pipeline_depth() -> None:
    store = SlowMarks([row(i, i % 2) for i in range(1, 201)])
    publisher = HeldReports()
    pump = Pump(store=store, publisher=publisher, leases=Leases(), nshards=2,  # type: ignore[arg-type]
                batch_size=BATCH, pipeline_depth=DEPTH, max_attempts=3, backoff_initial_s=0.1,
                backoff_max_s=1.0, metrics=RelayMetrics(), log=Log(), mark_store=store)
    pump.start()
    try:
        widest = 0
        for turn in range(30):
            # Batches are acknowledged at the next turn, then wait for their marks; from
            # the third turn on, the broker is slow too: new batches wait for reports.
            publisher.reporting = turn < 3
            pump.run_once()
            widest = max(widest, len(publisher.sent) - len(store.marked))
        assert len(pump.marking) >= 2 and pump.in_flight, "the two waits never overlapped"
        assert len(publisher.sent) == BATCH * DEPTH, "the pipeline never filled"
        assert widest == BATCH * DEPTH
        publisher.reporting = True
        store.gate.set()
        for _ in range(200):
            pump.run_once()
            pump.wait(0.01)
            widest = max(widest, len(publisher.sent) - len(store.marked))
            if not store.pending and not pump.busy():
                break
        assert not store.pending
        assert widest <= BATCH * DEPTH
        assert sorted(store.marked) == list(range(1, 201))
    finally:
        store.gate.set()
        pump.stop()
