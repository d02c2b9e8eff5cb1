"""The dispatcher's failed rounds in a row (:mod:`consumer_sdk.jobs.outage`): when the pool is
not ready, what it logs and when, and the gauge (pure: a fake clock, no database)."""

from __future__ import annotations

import random
from typing import Any

import psycopg
import structlog

from consumer_sdk.errors import AuthenticationFailed, DatabaseUnavailable, TransactionConflict
from consumer_sdk.jobs import StatementTimedOut, WorkerConfig, WorkerPool
from consumer_sdk.jobs.errors import DatabaseReadOnly
from consumer_sdk.jobs.metrics import JobsMetrics
from consumer_sdk.jobs.outage import LOG_EVERY_S, NOT_READY_S, Outage
from consumer_sdk.jobs.refusals import Refusals
from tests.fixtures.procs import wait_until

GAUGE = "outbox_jobs_database_unavailable"
DOWN = DatabaseUnavailable("database unreachable: connection failed: connection refused")
READ_ONLY = DatabaseReadOnly("the database is read-only (a standby, or a failover in progress): cannot execute "
                             "UPDATE in a read-only transaction; waiting for a writable primary")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _outage(logged: list[dict[str, Any]], metrics: JobsMetrics | None = None) -> tuple[Outage, Clock]:
    def record(_logger: Any, level: str, event: dict[str, Any]) -> dict[str, Any]:
        logged.append({**event, "level": level})
        raise structlog.DropEvent

    clock = Clock()
    outage = Outage(log=structlog.wrap_logger(None, processors=[record]), metrics=metrics or JobsMetrics(),
                    clock=clock)
    return outage, clock


def _fail(outage: Outage, clock: Clock, exc: Exception, *, rounds: int = 1, round_s: float = 0.1) -> None:
    """``rounds`` rounds of ``round_s`` each, every one failed with ``exc``."""
    for _ in range(rounds):
        began = clock.now
        clock.now += round_s
        outage.failed(exc, began=began)


def test_one_failed_round_is_a_blip_two_for_two_seconds_an_outage() -> None:
    metrics = JobsMetrics()
    outage, clock = _outage([], metrics)
    _fail(outage, clock, DOWN, round_s=5.0)  # one round, however long: its connection may just have ended
    assert outage.reason() is None and metrics.registry.get_sample_value(GAUGE) == 0.0
    assert outage.failed_rounds == 1
    outage.passed()
    _fail(outage, clock, DOWN, rounds=2, round_s=0.1)  # the reconnect failed too, a moment ago
    assert outage.reason() is None and metrics.registry.get_sample_value(GAUGE) == 0.0
    clock.now += NOT_READY_S  # two seconds since the first one began
    reason = outage.reason()
    assert reason == ("the database is unavailable (stopped, unreachable, or refusing connections) for 2 s (2 "
                      "dispatch rounds failed in a row, nothing claimed meanwhile): database unreachable: "
                      "connection failed: connection refused")
    assert metrics.registry.get_sample_value(GAUGE) == 1.0
    outage.passed()  # ready again at once
    assert outage.reason() is None and outage.failed_rounds == 0
    assert metrics.registry.get_sample_value(GAUGE) == 0.0


def test_a_read_only_database_is_named_so_with_its_words_once() -> None:
    outage, clock = _outage([])
    _fail(outage, clock, READ_ONLY, rounds=3, round_s=1.0)
    assert outage.reason() == ("the database is read-only (a standby, or a failover in progress) for 3 s (3 dispatch "
                               "rounds failed in a row, nothing claimed meanwhile): cannot execute UPDATE in a "
                               "read-only transaction; waiting for a writable primary")


def test_dispatch_failed_is_logged_once_per_outage_then_every_log_interval_and_its_end_once() -> None:
    logged: list[dict[str, Any]] = []
    outage, clock = _outage(logged)
    _fail(outage, clock, DOWN, rounds=50, round_s=0.5)  # 25 s
    assert [(e["event"], e["level"], e["rounds"]) for e in logged] == [("dispatch_failed", "warning", 1)]
    assert logged[0]["error"] == str(DOWN) and logged[0]["error_type"] == "DatabaseUnavailable"
    _fail(outage, clock, DOWN, rounds=10, round_s=0.5)  # 29.5 s after the first line (at the end of round 1)
    assert len(logged) == 1
    _fail(outage, clock, DOWN, round_s=0.5)  # 30 s
    assert [(e["event"], e["rounds"], e["failing_s"]) for e in logged[1:]] == [("dispatch_failed", 61, 30.5)]
    _fail(outage, clock, READ_ONLY)  # another cause: said at once
    assert [(e["error_type"], e["rounds"]) for e in logged[2:]] == [("DatabaseReadOnly", 62)]
    logged.clear()
    outage.passed()
    outage.passed()  # a second passing round: nothing more to say
    assert logged == [{"event": "dispatch_recovered", "level": "info", "rounds": 62, "failed_s": 30.6,
                       "error": str(READ_ONLY), "error_type": "DatabaseReadOnly"}]
    logged.clear()
    _fail(outage, clock, DOWN, rounds=3)  # the next outage is logged again, from its first round
    assert [(e["event"], e["rounds"]) for e in logged] == [("dispatch_failed", 1)]
    assert LOG_EVERY_S == 30.0


def test_a_round_that_passed_on_a_read_only_session_ends_nothing() -> None:
    # A standby with nothing to claim: the rounds that only read pass, its reaps fail.  Ended
    # by the reads, the outage would be over and back at every reap, two lines each time.
    logged: list[dict[str, Any]] = []
    outage, clock = _outage(logged)
    for _ in range(10):
        _fail(outage, clock, READ_ONLY, round_s=0.5)
        outage.passed(read_only_session=True)
    assert outage.failed_rounds == 10 and outage.reason() is not None
    assert [e["event"] for e in logged] == ["dispatch_failed"]
    outage.passed()  # a writable session's round
    assert [e["event"] for e in logged] == ["dispatch_failed", "dispatch_recovered"]
    assert outage.reason() is None


def test_other_failures_are_logged_once_but_do_not_say_the_database_is_out() -> None:
    logged: list[dict[str, Any]] = []
    outage, clock = _outage(logged)
    _fail(outage, clock, TransactionConflict("transaction aborted: deadlock detected"), rounds=30, round_s=0.5)
    assert [e["event"] for e in logged] == ["dispatch_failed"]
    assert outage.reason() is None and outage.failed_rounds == 0


def test_a_password_in_the_error_is_neither_logged_nor_shown() -> None:
    logged: list[dict[str, Any]] = []
    outage, clock = _outage(logged)
    leaky = DatabaseUnavailable("database unreachable: connection to postgresql://app:s3cret-pw@db:5432/app failed")
    _fail(outage, clock, leaky, rounds=3, round_s=1.0)
    reason = outage.reason()
    assert reason is not None and "s3cret-pw" not in reason and "***" in reason
    assert "s3cret-pw" not in logged[0]["error"]


def test_close_ends_it_without_a_line() -> None:
    logged: list[dict[str, Any]] = []
    metrics = JobsMetrics()
    outage, clock = _outage(logged, metrics)
    _fail(outage, clock, DOWN, rounds=5, round_s=1.0)
    outage.close()
    assert outage.reason() is None and metrics.registry.get_sample_value(GAUGE) == 0.0
    assert [e["event"] for e in logged] == ["dispatch_failed"]


def test_the_pools_health_carries_the_reason_and_the_rounds() -> None:
    refusals = Refusals(log=structlog.get_logger(), rand=random.random)
    health = refusals.health(error=None, started=True, stopping=False, database="the database is unavailable ...",
                             failed_rounds=7)
    assert not health.ready and health.reasons == ("the database is unavailable ...",) and health.failed_rounds == 7
    health = refusals.health(error=None, started=True, stopping=False, failed_rounds=1)  # a blip: no reason yet
    assert health.ready and health.failed_rounds == 1


def test_a_fatal_error_during_an_outage_stops_the_pool_without_saying_it_recovered() -> None:
    # The database comes back with the credentials rejected (rotated during the outage): the
    # pool stops (pool_failed), and no dispatch_recovered line reads that as a recovery.
    logged: list[dict[str, Any]] = []
    attempts = iter(range(1_000))

    def connect() -> Any:
        if next(attempts) < 5:
            raise DatabaseUnavailable("database unreachable: connection refused")
        raise AuthenticationFailed("password authentication failed for user \"app\"")

    def record(_logger: Any, _level: str, event: dict[str, Any]) -> dict[str, Any]:
        logged.append(event)
        raise structlog.DropEvent

    metrics = JobsMetrics()
    pool = WorkerPool(WorkerConfig(dsn="postgresql://app@db/app", poll_interval_s=0.05, listen=False),
                      {"k": lambda ctx: None}, metrics=metrics, connect=connect,
                      log=structlog.wrap_logger(None, processors=[record]))
    pool.start()
    try:
        wait_until(lambda: pool.error is not None, timeout_s=10, message=lambda: str(logged[-3:]))
    finally:
        pool.stop(drain_timeout_s=0.5)
    events = [e["event"] for e in logged if e["event"].startswith(("dispatch_", "pool_failed"))]
    assert events == ["dispatch_failed", "pool_failed"], events
    assert isinstance(pool.error, AuthenticationFailed)
    assert metrics.registry.get_sample_value(GAUGE) == 0.0
    assert not pool.health().ready and pool.health().failed_rounds == 0


def test_statements_the_pools_statement_timeout_cancelled_on_a_lock_keep_the_pool_ready() -> None:
    """A lock wait is not an outage (see the module): a claim that pool_statement_timeout_s
    cancelled while the lock-wait watch found it waiting on a lock (an operator's LOCK TABLE
    held for minutes) is logged, but the pool stays ready, as it does while the statement
    waits; the same cancel with no lock wait found is a slow database, an outage."""
    timed_out = StatementTimedOut("statement_timeout cancelled the statement (canceling statement due to "
                                  "statement timeout)")
    logged: list[dict[str, Any]] = []
    lock_wait_s = [25.0]
    outage, clock = _outage(logged)
    outage.lock_wait_s = lambda: lock_wait_s[0]
    _fail(outage, clock, timed_out, rounds=3, round_s=20.0)
    assert outage.reason() is None and outage.failed_rounds == 0
    assert "waited on a lock" in logged[0]["hint"]
    outage.passed()
    lock_wait_s[0] = 0.0
    _fail(outage, clock, timed_out, rounds=2, round_s=20.0)
    reason = outage.reason()
    assert reason is not None and "statement_timeout" in reason and outage.failed_rounds == 2


def test_a_cancel_told_by_its_sqlstate_alone_on_a_lock_keeps_the_pool_ready() -> None:
    """Under another lc_messages a statement_timeout's cancel is not told by its words (a plain
    DatabaseUnavailable, see consumer_sdk/jobs/_db.py): its SQLSTATE (57014, shared with a
    cancel request) with a lock wait found is still a lock wait, not an outage."""
    cancel = psycopg.errors.QueryCanceled("Abbruch der Anweisung wegen Zeitüberschreitung")
    foreign = DatabaseUnavailable("database unavailable: Abbruch der Anweisung wegen Zeitüberschreitung")
    foreign.__cause__ = cancel
    outage, clock = _outage([])
    outage.lock_wait_s = lambda: 25.0
    _fail(outage, clock, foreign, rounds=3, round_s=20.0)
    assert outage.reason() is None and outage.failed_rounds == 0
    outage.passed()
    outage.lock_wait_s = lambda: 0.0
    _fail(outage, clock, foreign, rounds=2, round_s=20.0)
    assert outage.reason() is not None and outage.failed_rounds == 2
