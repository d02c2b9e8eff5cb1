"""LockWaitWatch's logic (consumer_sdk/inbox_waits.py): when it looks, what it logs, how
often.  The catalog's rows are given here; the real read is in
tests/integration/sdk/test_sdk_hung_member_lock_wait.py."""

from __future__ import annotations

from typing import Any

import structlog
from structlog.testing import capture_logs

from consumer_sdk.inbox_waits import LOG_EVERY_S, LockWaitWatch
from consumer_sdk.metrics import ConsumerMetrics

OWN_PID = 101
BLOCKER = {"pid": 202, "application_name": "outbox-consumer:svc", "state": "idle in transaction",
           "query": "SELECT pg_advisory_lock_shared(42)"}


class Rows:
    """A connection that answers the watch's read with ``rows`` (and counts the reads)."""

    def __init__(self, rows: list[tuple[Any, ...]]) -> None:
        self.rows, self.reads, self.closed, self.autocommit = rows, 0, False, True

    def execute(self, _query: str, _params: Any) -> Rows:
        self.reads += 1
        return self

    def fetchall(self) -> list[tuple[Any, ...]]:
        return self.rows

    def close(self) -> None:
        self.closed = True


def _row(pid: int, event_type: str = "Lock") -> tuple[Any, ...]:
    return (pid, "outbox-consumer:svc", 12.3, event_type, "transactionid", None, "ShareLock", [BLOCKER])


def _watch(conn: Rows, clock: list[float], busy: list[float]) -> LockWaitWatch:
    return LockWaitWatch(lambda: conn, session=lambda: (OWN_PID, "outbox-consumer:svc"), busy_s=lambda: busy[0],
                         log=structlog.get_logger(), after_s=5.0, clock=lambda: clock[0])


def test_it_looks_only_while_a_batch_takes_long_and_names_the_blocking_backend() -> None:
    # another member's session (same application_name) and a statement that runs, not waits
    conn = Rows([_row(OWN_PID), _row(999), _row(OWN_PID, event_type="IO")])
    clock, busy = [0.0], [1.0]
    watch = _watch(conn, clock, busy)
    with capture_logs() as logs:
        assert watch.run_once() == [] and conn.reads == 0  # no batch takes long: no read
        busy[0] = 6.0
        [wait] = watch.run_once()
        clock[0] += 2
        watch.run_once()  # the same wait, 2 s later: not logged again
        clock[0] += LOG_EVERY_S
        watch.run_once()  # and again once LOG_EVERY_S went by
        busy[0] = 0.0
        watch.run_once()
    assert wait["pid"] == OWN_PID and [b["pid"] for b in wait["blockers"]] == [202]
    waits = [e for e in logs if e["event"] == "database_lock_wait"]
    assert len(waits) == 2 and waits[0]["blocking_pids"] == [202]
    assert "held by backend pid 202 (outbox-consumer:svc, idle in transaction)" in waits[0]["detail"]
    assert [e["blocking_pids"] for e in logs if e["event"] == "database_wait_over"] == [[202]]
    assert conn.closed  # the connection is given back once the batch is done


def test_a_database_away_changes_nothing() -> None:
    def refuse() -> Any:
        raise OSError("connection refused")

    watch = LockWaitWatch(refuse, session=lambda: (OWN_PID, "x"), busy_s=lambda: 60.0,
                          log=structlog.get_logger())
    with capture_logs() as logs:
        assert watch.run_once() == []
    assert [e["event"] for e in logs] == ["database_waits_unknown"]


def _lock_wait(metrics: ConsumerMetrics) -> float | None:
    return metrics.registry.get_sample_value("outbox_consumer_lock_wait_seconds", {"consumer": "svc"})


def test_the_gauge_shows_the_longest_wait_of_the_last_look_and_falls_back_to_zero() -> None:
    metrics = ConsumerMetrics()
    longer = (OWN_PID, "outbox-consumer:svc", 47.6, "Lock", "tuple", "inbox", "ShareLock", [BLOCKER])
    conn = Rows([_row(OWN_PID), _row(999, event_type="Lock")])
    busy, away = [6.0], [False]

    def connect() -> Rows:
        if away[0]:
            raise OSError("connection refused")
        return conn

    watch = LockWaitWatch(connect, session=lambda: (OWN_PID, "outbox-consumer:svc"), busy_s=lambda: busy[0],
                          log=structlog.get_logger(), after_s=5.0,
                          wait_gauge=metrics.lock_wait.labels("svc"))
    assert _lock_wait(metrics) == 0.0
    watch.run_once()
    assert _lock_wait(metrics) == 12.3  # its own session's wait; another member's is not counted
    conn.rows = [_row(OWN_PID), longer]
    watch.run_once()
    assert _lock_wait(metrics) == 47.6  # the longest
    conn.rows = [_row(OWN_PID, event_type="IO")]
    watch.run_once()
    assert _lock_wait(metrics) == 0.0  # the statement runs on: no lock wait
    conn.rows = [_row(OWN_PID)]
    watch.run_once()
    assert _lock_wait(metrics) == 12.3
    busy[0] = 0.0
    watch.run_once()
    assert _lock_wait(metrics) == 0.0  # the batch is done
    busy[0], conn.closed = 6.0, False
    watch.run_once()
    away[0], conn.closed = True, True  # the database goes away: the next look cannot be made
    watch.run_once()
    assert _lock_wait(metrics) == 0.0
    away[0] = False
    watch.run_once()
    assert _lock_wait(metrics) == 12.3
    watch.stop()
    assert _lock_wait(metrics) == 0.0  # a stopped consumer waits on nothing
