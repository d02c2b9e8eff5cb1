"""A mark statement the server cancelled (relay/mark_cancels.py, relay/marker.py Marker):
marked again on its connection with the same rows and lease tokens after a back-off, split
in halves when cancelled again, never failed up to the loop (which rewound: every row of
the marks in flight published again).  Pure logic: the store is faked, the clock too."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from relay.errors import StatementCancelled
from relay.mark_cancels import SPLIT_FLOOR_ROWS, SPLIT_HOLD_S, MarkCancels
from relay.marker import MarkCancelled, Marker
from relay.model import Lease, OutboxRow, ShardId, Token
from tests.unit.pump_fakes import Store
from tests.unit.test_heartbeat_late import Log
from tests.unit.test_marker import row
from tests.unit.test_pump_inline_mark import ThreadNoting, pump_on

TOKENS = {ShardId(s): Token(10 + s) for s in range(8)}


class Cancelling:
    """A mark store whose statements are cancelled while ``cancel(rows)`` says so; records
    each statement's rows and leases."""

    name = "outbox-relay:me:mark"

    def __init__(self, cancel: Callable[[list[OutboxRow]], bool]) -> None:
        self.cancel = cancel
        self.statements: list[list[int]] = []
        self.leases: list[list[Lease]] = []
        self.tried = threading.Event()

    def mark_published(self, *, owner: str, leases: list[Lease], rows: list[OutboxRow]) -> Any:
        self.statements.append([r.id for r in rows])
        self.leases.append(list(leases))
        self.tried.set()
        if self.cancel(rows):
            raise StatementCancelled("statement cancelled: canceling statement due to statement timeout")
        return {lease.shard for lease in leases}, {r.id for r in rows}


def _marker(store: Cancelling, clock: Callable[[], float]) -> tuple[Marker, Log, list[str]]:
    log, counted = Log(), []
    marker = Marker(store, "me", log=log, on_cancel=counted.append)  # type: ignore[arg-type]
    marker.cancels = MarkCancels(clock, log=log)
    return marker, log, counted


def _rows(count: int) -> list[OutboxRow]:
    return [row(i, shard=i % 8) for i in range(1, count + 1)]


def test_a_cancelled_mark_is_marked_again_with_the_same_rows_and_tokens_after_its_back_off() -> None:
    ticks = [0.0]

    def clock() -> float:  # each look moves time on by 0.25 s
        ticks[0] += 0.25
        return ticks[0]

    cancels = iter([True])
    store = Cancelling(lambda rows: next(cancels, False))
    marker, log, counted = _marker(store, clock)
    marker.start()
    try:
        held, marked, _took = marker.submit(TOKENS, _rows(10)).result(timeout=10)
    finally:
        marker.stop()
    assert marked == set(range(1, 11)) and held == set(TOKENS), (held, marked)
    assert store.statements == [list(range(1, 11))] * 2 and store.leases[0] == store.leases[1]
    assert counted == ["outbox-relay:me:mark"]
    assert [event for event, _ in log.events] == ["mark_statement_cancelled", "mark_statement_recovered"]
    said = log.events[0][1]
    assert said["connection"] == "outbox-relay:me:mark" and said["rows"] == 10, said
    assert "statement_timeout" in str(said["detail"]) and "none is published again" in str(said["detail"]).lower()
    assert log.events[1][1]["cancelled"] == 1 and log.events[1][1]["after_s"] >= 1.0, log.events


def test_a_big_mark_cancelled_again_is_split_in_halves_marked_in_claim_order() -> None:
    ticks = [0.0]

    def clock() -> float:
        ticks[0] += 1.0
        return ticks[0]

    store = Cancelling(lambda rows: len(rows) > SPLIT_FLOOR_ROWS)  # a timeout shorter than big marks
    marker, log, counted = _marker(store, clock)
    marker.start()
    try:
        _held, marked, _took = marker.submit(TOKENS, _rows(4 * SPLIT_FLOOR_ROWS)).result(timeout=10)
        again = marker.submit(TOKENS, _rows(3 * SPLIT_FLOOR_ROWS)).result(timeout=10)  # the split holds
    finally:
        marker.stop()
    assert marked == set(range(1, 4 * SPLIT_FLOOR_ROWS + 1)) and len(again[1]) == 3 * SPLIT_FLOOR_ROWS
    sizes = [len(statement) for statement in store.statements]
    assert sizes == [400, 400, 200, 100, 100, 100, 100, 100, 100, 100], sizes
    committed = [i for statement in store.statements[3:7] for i in statement]
    assert committed == list(range(1, 401))  # in claim order: a key's rows marked in order
    assert len(counted) == 3 and [event for event, _ in log.events].count("mark_statement_cancelled") == 1


def test_a_split_is_lifted_after_a_quiet_spell() -> None:
    now = [0.0]
    cancels = MarkCancels(lambda: now[0])
    cancels.cancelled("c", MarkCancelled("x", store=None, rows=1000, took_s=0.3))
    assert cancels.split(1000) == 1000 and cancels.waiting()  # the same rows first, after the back-off
    cancels.cancelled("c", MarkCancelled("x", store=None, rows=1000, took_s=0.3))
    assert cancels.split(1000) == 500 and cancels.statement_rows(2000) == 500
    cancels.passed("c", 500)
    assert not cancels.waiting() and cancels.in_a_row == 0
    now[0] += SPLIT_HOLD_S + 1
    assert cancels.statement_rows(2000) == 2000


def test_a_stop_ends_the_wait_of_a_mark_cancelled_again_and_again() -> None:
    store = Cancelling(lambda rows: True)  # a lock held for ever
    marker, _log, _counted = _marker(store, lambda: 0.0)  # a frozen clock: the back-off never ends
    marker.start()
    future = marker.submit(TOKENS, _rows(5))
    assert store.tried.wait(10)
    stopping = threading.Thread(target=marker.stop, args=(10.0,))
    stopping.start()
    with pytest.raises(MarkCancelled):  # its rows stay pending: claimed again by whoever holds them
        future.result(timeout=5)
    stopping.join(5)
    assert not stopping.is_alive()


class CancelledOnce(ThreadNoting):
    """Its first mark is cancelled by the server."""

    def mark_published(self, *, owner: str, leases: Any, rows: Any) -> Any:
        cancel = not self.threads
        self.threads.append(threading.current_thread().name)
        if cancel:
            raise StatementCancelled("statement cancelled: canceling statement due to statement timeout")
        return Store.mark_published(self, owner=owner, leases=leases, rows=rows)


def test_a_mark_cancelled_on_the_pumps_thread_is_marked_again_by_the_mark_thread() -> None:
    store = CancelledOnce([row(1, 0), row(2, 1)])
    pump = pump_on(store, batch_size=100)
    assert pump._marker is not None
    ticks = [0.0]

    def clock() -> float:
        ticks[0] += 0.5
        return ticks[0]

    pump._marker.lanes[0].cancels = MarkCancels(clock)
    pump.start()
    try:
        pump.run_once()
        pump.run_once()  # settles: marked inline, cancelled, handed to the mark thread (not raised)
        for _ in range(200):
            if not pump.busy():
                break
            pump.wait(0.05)
            pump.run_once()
        assert sorted(store.marked) == [1, 2] and pump.totals.marked == 2
        assert store.threads == [threading.current_thread().name, "outbox-relay-mark"], store.threads
        assert pump.metrics.registry.get_sample_value("outbox_relay_mark_statements_cancelled_total",
                                                      {"connection": "outbox-relay-mark"}) == 1
    finally:
        pump.stop()
