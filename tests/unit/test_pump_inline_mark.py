"""At steady rates a drained window's small batch is marked on the pump's own thread:
nothing could run meanwhile, and a hand-off to the mark thread costs two wake-ups.  A
backlog's batches still go to the mark thread, so the next claim overlaps their mark.
A failed inline mark is raised where the mark thread's would be.  Pure logic: fakes."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from relay.errors import DatabaseUnavailable
from relay.metrics import RelayMetrics
from relay.model import RowId, ShardId
from relay.pump import INLINE_MARK_ROWS, Pump
from tests.unit.pump_fakes import Leases, Log, Publisher, Store, row


class ThreadNoting(Store):
    """Notes the thread each mark ran on; fails while ``failing``."""

    def __init__(self, rows: Any) -> None:
        super().__init__(rows)
        self.threads: list[str] = []
        self.failing = False

    def mark_published(self, *, owner: str, leases: Any, rows: Any) -> tuple[set[ShardId], set[RowId]]:
        self.threads.append(threading.current_thread().name)
        if self.failing:
            raise DatabaseUnavailable("connection lost")
        return super().mark_published(owner=owner, leases=leases, rows=rows)


def pump_on(store: ThreadNoting, batch_size: int) -> Pump:
    return Pump(store=store, publisher=Publisher(), leases=Leases(), nshards=2,  # type: ignore[arg-type]
                batch_size=batch_size, pipeline_depth=4, max_attempts=3, backoff_initial_s=0.1,
                backoff_max_s=1.0, metrics=RelayMetrics(), log=Log(), mark_store=store)


def test_a_drained_small_batch_is_marked_on_the_pumps_thread() -> None:
    store = ThreadNoting([row(i, i % 2) for i in range(1, 6)])
    pump = pump_on(store, batch_size=100)
    pump.start()
    try:
        pump.run_once()  # claims the 5 rows: the window is drained
        assert pump.caught_up
        pump.run_once()  # settles them: marked at once, here
        assert store.threads == [threading.current_thread().name]
        assert sorted(store.marked) == [1, 2, 3, 4, 5]
        assert pump.totals.marked == 5 and not pump.busy()
    finally:
        pump.stop()


def test_a_backlogs_batches_go_to_the_mark_thread() -> None:
    rows = INLINE_MARK_ROWS * 3
    store = ThreadNoting([row(i, i % 2) for i in range(1, rows + 1)])
    pump = pump_on(store, batch_size=INLINE_MARK_ROWS)
    pump.start()
    try:
        for _ in range(50):
            pump.run_once()
            pump.wait(0.01)
            if not store.pending and not pump.busy():
                break
        assert not store.pending
        assert store.threads and set(store.threads) == {"outbox-relay-mark"}
    finally:
        pump.stop()


def test_a_failed_inline_mark_raises_from_the_turn_and_its_rows_stay_pending() -> None:
    store = ThreadNoting([row(1, 0), row(2, 1)])
    pump = pump_on(store, batch_size=100)
    pump.start()
    try:
        pump.run_once()
        store.failing = True
        with pytest.raises(DatabaseUnavailable):
            pump.run_once()
        assert store.threads == [threading.current_thread().name]
        assert sorted(store.pending) == [1, 2] and not pump.marking
    finally:
        pump.stop()


class LeaseNoting(ThreadNoting):
    """Notes the shards each mark was fenced by."""

    def __init__(self, rows: Any) -> None:
        super().__init__(rows)
        self.fenced_by: list[list[int]] = []

    def mark_published(self, *, owner: str, leases: Any, rows: Any) -> tuple[set[ShardId], set[RowId]]:
        self.fenced_by.append(sorted(lease.shard for lease in leases))
        return super().mark_published(owner=owner, leases=leases, rows=rows)


def test_an_inline_mark_is_fenced_by_its_rows_shards_only() -> None:
    """As the mark thread's parts are: a mark of rows of one shard locks and checks that
    shard's lease row, not the sixteen the relay holds (before: every held lease, one
    Lease object and four array elements each, and a FOR SHARE lock on each lease row)."""
    store = LeaseNoting([row(i, 3) for i in range(1, 4)] + [row(i, 5) for i in range(4, 6)])
    pump = Pump(store=store, publisher=Publisher(), leases=Leases(range(8)), nshards=8,  # type: ignore[arg-type]
                batch_size=100, pipeline_depth=4, max_attempts=3, backoff_initial_s=0.1,
                backoff_max_s=1.0, metrics=RelayMetrics(), log=Log(), mark_store=store)
    pump.start()
    try:
        pump.run_once()
        pump.run_once()
        assert store.threads == [threading.current_thread().name]  # the inline path
        assert store.fenced_by == [[3, 5]]
        assert sorted(store.marked) == [1, 2, 3, 4, 5] and pump.totals.marked == 5
    finally:
        pump.stop()
