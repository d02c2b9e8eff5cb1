"""PoolLockWaitWatch's logic (consumer_sdk/jobs/lock_waits.py): when it looks, which sessions,
what it logs, how often, the gauge per queue.  The catalog's rows are given here; the real
read is in tests/integration/jobs/test_jobs_lock_wait.py."""

from __future__ import annotations

from typing import Any

import structlog
from structlog.testing import capture_logs

from consumer_sdk.jobs.lock_waits import InUseSince, PoolLockWaitWatch, PoolSession
from consumer_sdk.jobs.metrics import JobsMetrics
from outbox_core.waits import LOG_EVERY_S

DISPATCHER, HEARTBEAT, OTHER_POOL = 101, 102, 999
NAME = "outbox-jobs-worker"
BLOCKER = {"pid": 202, "application_name": "psql", "state": "idle in transaction",
           "query": "LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE"}


class Rows:
    """A connection that answers the watch's read with ``rows`` (and counts the reads)."""

    def __init__(self, rows: list[tuple[Any, ...]]) -> None:
        self.rows, self.reads, self.closed, self.autocommit = rows, 0, False, True
        self.names: list[str] = []

    def execute(self, _query: str, params: dict[str, Any]) -> Rows:
        self.reads += 1
        self.names = params["names"]
        return self

    def fetchall(self) -> list[tuple[Any, ...]]:
        return self.rows

    def close(self) -> None:
        self.closed = True


def _row(pid: int, waited_s: float = 12.3, event_type: str = "Lock") -> tuple[Any, ...]:
    return (pid, NAME, waited_s, event_type, "relation", "jobs", "RowExclusiveLock", [BLOCKER])


class Pool:
    """The pool's two sessions as the watch sees them: ``busy`` says since when each has had a
    statement in flight (None: idle)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.busy: dict[str, float | None] = {"dispatcher": None, "heartbeat": None}
        self.pids: dict[str, int | None] = {"dispatcher": DISPATCHER, "heartbeat": HEARTBEAT}

    def session(self, role: str) -> PoolSession:
        def pid_and_name() -> tuple[int, str] | None:
            pid = self.pids[role]
            return None if pid is None else (pid, NAME)

        return PoolSession(role=role, session=pid_and_name, busy_since=lambda: self.busy[role])


def _watch(conn: Rows, pool: Pool, metrics: JobsMetrics) -> PoolLockWaitWatch:
    return PoolLockWaitWatch(lambda: conn, sessions=[pool.session("dispatcher"), pool.session("heartbeat")],
                             metrics=metrics, queues=["interactive", "bulk"], log=structlog.get_logger(),
                             after_s=5.0, clock=lambda: pool.now)


def _gauge(metrics: JobsMetrics, queue: str) -> float | None:
    return metrics.registry.get_sample_value("outbox_jobs_lock_wait_seconds", {"queue": queue})


def test_it_looks_only_while_a_session_takes_long_and_names_the_blocker_per_session() -> None:
    # another pool's session (same application_name) and a statement that runs, not waits
    conn = Rows([_row(DISPATCHER), _row(HEARTBEAT, 47.6), _row(OTHER_POOL, 99.0), _row(DISPATCHER, event_type="IO")])
    pool, metrics = Pool(), JobsMetrics()
    watch = _watch(conn, pool, metrics)
    assert _gauge(metrics, "interactive") == 0.0 and _gauge(metrics, "bulk") == 0.0  # exported before any wait
    with capture_logs() as logs:
        pool.busy["dispatcher"] = pool.now - 4.0
        assert watch.run_once() == () and conn.reads == 0  # 4 s: not yet
        pool.busy["dispatcher"] = pool.now - 6.0
        waits = watch.run_once()
        assert conn.names == [NAME] and {w.pid for w in waits} == {DISPATCHER, HEARTBEAT}
        assert _gauge(metrics, "interactive") == 47.6 and _gauge(metrics, "bulk") == 47.6  # the longer
        pool.now += 2
        watch.run_once()  # the same waits, 2 s later: not logged again
        pool.now += LOG_EVERY_S
        watch.run_once()  # and again once LOG_EVERY_S went by
        pool.busy["dispatcher"] = None
        watch.run_once()
    lines = [e for e in logs if e["event"] == "jobs_lock_wait"]
    assert [(e["session"], e["pid"]) for e in lines] == [("dispatcher", DISPATCHER), ("heartbeat", HEARTBEAT)] * 2
    dispatcher, heartbeat = lines[:2]
    assert dispatcher["log_level"] == "warning" and dispatcher["blocking_pids"] == [202]
    assert dispatcher["blockers"] == ["psql"] and dispatcher["relation"] == "jobs"
    assert dispatcher["detail"] == ("the pool's dispatcher (its claims and reaps) has waited 12 s on a lock "
                                    "(jobs, RowExclusiveLock), held by backend pid 202 (psql, idle in "
                                    "transaction): LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")
    assert "claims no job" in dispatcher["hint"] and "pg_terminate_backend(pid)" in dispatcher["hint"]
    assert "renews no lease" in heartbeat["hint"] and "lease_duration_s" in heartbeat["hint"]
    over = [e for e in logs if e["event"] == "jobs_lock_wait_over"]
    assert over == [{"event": "jobs_lock_wait_over", "log_level": "info", "sessions": ["dispatcher", "heartbeat"],
                     "blocking_pids": [202]}]
    assert _gauge(metrics, "interactive") == 0.0 and conn.closed  # over: 0, the connection given back


def test_a_session_without_a_connection_is_not_looked_at() -> None:
    conn = Rows([_row(DISPATCHER), _row(HEARTBEAT)])
    pool, metrics = Pool(), JobsMetrics()
    watch = _watch(conn, pool, metrics)
    pool.busy["dispatcher"] = pool.busy["heartbeat"] = pool.now - 60.0
    pool.pids["dispatcher"] = None  # reconnecting: its old pid may be anyone's now
    assert [w.pid for w in watch.run_once()] == [HEARTBEAT]
    pool.pids["heartbeat"] = None
    assert watch.run_once() == () and _gauge(metrics, "bulk") == 0.0


def test_a_database_away_changes_nothing_and_a_stop_resets_the_gauge() -> None:
    conn, away = Rows([_row(HEARTBEAT)]), [False]

    def connect() -> Rows:
        if away[0]:
            raise OSError("connection refused")
        return conn

    pool, metrics = Pool(), JobsMetrics()
    watch = PoolLockWaitWatch(connect, sessions=[pool.session("heartbeat")], metrics=metrics, queues=["bulk"],
                              log=structlog.get_logger(), clock=lambda: pool.now)
    pool.busy["heartbeat"] = pool.now - 60.0
    watch.run_once()
    assert _gauge(metrics, "bulk") == 12.3
    away[0], conn.closed = True, True
    with capture_logs() as logs:
        assert watch.run_once() == ()
    assert [e["event"] for e in logs] == ["database_waits_unknown"] and _gauge(metrics, "bulk") == 0.0
    away[0] = False
    watch.run_once()
    assert _gauge(metrics, "bulk") == 12.3
    watch.stop()
    assert _gauge(metrics, "bulk") == 0.0 and conn.closed  # a stopped pool waits on nothing


def test_in_use_since_is_when_a_statement_was_first_seen_in_flight_at_every_look_since() -> None:
    now, in_use = [0.0], [False]
    since = InUseSince(lambda: in_use[0], lambda: now[0])
    assert since() is None
    in_use[0], now[0] = True, 2.0
    assert since() == 2.0
    now[0] = 4.0
    assert since() == 2.0  # still in use: since the first look that saw it
    in_use[0], now[0] = False, 6.0
    assert since() is None
    in_use[0], now[0] = True, 8.0
    assert since() == 8.0  # in use again: a new statement, as far as the watch can tell
