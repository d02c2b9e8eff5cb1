"""A drained window's small batch is marked on the pump's own thread, but not when the mark
store's connection must be re-opened first (relay.reopening.CheckedStore.needs_reopen):
behind a session pooler with no server free the re-open waited there, and the loop's
thread with it (no heartbeat, no claim).  Such a batch goes to the mark thread.  Pure
logic: fakes (tests/integration/test_pgbouncer_reconnect.py for real PgBouncer)."""

from __future__ import annotations

import threading
from typing import Any

from relay.metrics import RelayMetrics
from relay.model import RowId, ShardId
from relay.pump import Pump
from tests.unit.pump_fakes import Leases, Log, Publisher, Store, row


class Reopening(Store):
    """Notes the thread each mark ran on; ``needs_reopen`` as CheckedStore says it."""

    def __init__(self, rows: Any) -> None:
        super().__init__(rows)
        self.threads: list[str] = []
        self.needs_reopen = False

    def mark_published(self, *, owner: str, leases: Any, rows: Any) -> tuple[set[ShardId], set[RowId]]:
        self.threads.append(threading.current_thread().name)
        self.needs_reopen = False  # its statement re-opened it
        return super().mark_published(owner=owner, leases=leases, rows=rows)


def _marked_on(store: Reopening, pump: Pump) -> str:
    pump.run_once()  # claims the rows: the window is drained
    assert pump.caught_up
    for _ in range(100):
        pump.run_once()
        pump.wait(0.01)
        if not store.pending and not pump.busy():
            break
    assert not store.pending and not pump.busy()
    (thread,) = store.threads[-1:]
    return thread


def test_a_small_batch_whose_mark_connection_must_be_reopened_goes_to_the_mark_thread() -> None:
    store = Reopening([row(i, i % 2) for i in range(1, 6)])
    pump = Pump(store=store, publisher=Publisher(), leases=Leases(), nshards=2,  # type: ignore[arg-type]
                batch_size=100, pipeline_depth=4, max_attempts=3, backoff_initial_s=0.1,
                backoff_max_s=1.0, metrics=RelayMetrics(), log=Log(), mark_store=store)
    pump.start()
    try:
        store.needs_reopen = True  # its connection broke at the last mark
        assert _marked_on(store, pump) == "outbox-relay-mark"
        store.pending = {r.id: r for r in (row(i, i % 2) for i in range(6, 9))}
        pump.expect_new_rows()
        assert _marked_on(store, pump) == threading.current_thread().name  # open again: inline
        assert sorted(store.marked) == list(range(1, 9)) and pump.totals.marked == 8
    finally:
        pump.stop()
