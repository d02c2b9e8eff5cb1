"""Which handler failures are not the job's doing besides a broken connection: a conflict
(SQLSTATE class 40) and a read-only database (25006) are given back uncounted within the same
budget (consumer_sdk.jobs.interruptions), the dead letter past it says how many of each, and
every give-back cause's series exists at 0 before the first one."""

from __future__ import annotations

import psycopg
import psycopg.errors
import pytest

from consumer_sdk.errors import TransactionConflict
from consumer_sdk.jobs import JobsMetrics
from consumer_sdk.jobs.errors import DatabaseReadOnly, FencedTransactionAborted
from consumer_sdk.jobs.retry import interruption, interruptions_note


class _Conn:
    def __init__(self, *, broken: bool = False) -> None:
        self.closed, self.broken = False, broken


ALIVE = _Conn()


@pytest.mark.parametrize(("exc", "cause"), [
    (psycopg.errors.SerializationFailure("could not serialize access"), "conflict"),  # 40001
    (psycopg.errors.DeadlockDetected("deadlock detected"), "conflict"),  # 40P01
    (TransactionConflict("transaction aborted: 40001"), "conflict"),  # fenced_transaction() caught it
    (psycopg.errors.ReadOnlySqlTransaction("cannot execute INSERT in a read-only transaction"), "read_only"),
    (DatabaseReadOnly("the database is read-only"), "read_only"),
    (psycopg.errors.AdminShutdown("terminating connection"), "connection_broke"),
])
def test_a_conflict_or_a_read_only_database_is_not_the_jobs_doing(exc: Exception, cause: str) -> None:
    assert interruption(exc, ALIVE) == cause


def test_a_handler_that_wraps_the_conflict_is_read_through() -> None:
    try:
        try:
            raise psycopg.errors.DeadlockDetected("deadlock detected")
        except psycopg.Error as caught:
            raise RuntimeError("could not book the seat") from caught
    except RuntimeError as wrapped:
        assert interruption(wrapped, ALIVE) == "conflict"


@pytest.mark.parametrize("exc", [
    psycopg.errors.UniqueViolation("duplicate key"), psycopg.errors.QueryCanceled("statement timeout"),
    FencedTransactionAborted("22012 division by zero"), ValueError("the job's own"),
])
def test_the_jobs_own_failures_are_no_interruption(exc: Exception) -> None:
    assert interruption(exc, ALIVE) is None


def test_the_note_past_the_budget_says_how_many_of_each() -> None:
    note = interruptions_note("read_only", {"connection_broke": 1, "conflict": 7, "read_only": 2}, 10)
    assert note == (" (through no fault of its own again: a read-only database; the pool's max_interruptions=10 "
                    "were spent (its database connection broke once, a conflict (a deadlock or a serialization "
                    "failure) 7 times, a read-only database 2 times), so each such attempt counts)")
    # Only the connection broke, ever: the words of before.
    assert interruptions_note("connection_broke", {"connection_broke": 2, "conflict": 0, "read_only": 0}, 2) == (
        " (the database connection broke under this job's attempts 3 times: past the pool's max_interruptions=2, "
        "each such attempt counts)")


def test_every_cause_of_a_queue_is_at_0_before_the_first() -> None:
    metrics = JobsMetrics()
    metrics.serve("bulk")
    value = metrics.registry.get_sample_value
    for cause in ("connection_broke", "conflict", "read_only", "prepared_statement_lost", "interruptions_exhausted"):
        assert value("outbox_jobs_given_back_total", {"queue": "bulk", "cause": cause}) == 0.0, cause
    assert value("outbox_jobs_given_back_total", {"queue": "interactive", "cause": "conflict"}) is None
