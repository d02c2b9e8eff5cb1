"""The jobs' seam with psycopg (consumer_sdk.jobs._db.translated): what passes is retried,
a refusal of the row fails that job for good, a missing grant stops a pool, by SQLSTATE.

Read by driver class alone, a CHECK violation (IntegrityError) and a size limit were the
row's, but a value PostgreSQL could not read (DataError) or a trigger's RAISE were a
FatalError, which stopped a pool, and idle_in_transaction_session_timeout (an InternalError)
too (an audit of the pool)."""

from __future__ import annotations

import psycopg
import psycopg.errors as pg
import pytest

from consumer_sdk.errors import DatabaseUnavailable, FatalError, SchemaMissing, TransactionConflict
from consumer_sdk.jobs import DatabaseReadOnly, InvalidJob, PrivilegeMissing
from consumer_sdk.jobs._db import translated


@pytest.mark.parametrize(("raised", "expected"), [
    # passing: the connection, a conflict, a cancel, a lock timeout, a shutdown, resources
    (psycopg.OperationalError("server closed the connection unexpectedly"), DatabaseUnavailable),
    (pg.SerializationFailure("could not serialize access"), TransactionConflict),
    (pg.DeadlockDetected("deadlock detected"), TransactionConflict),
    (pg.LockNotAvailable("canceling statement due to lock timeout"), DatabaseUnavailable),
    (pg.QueryCanceled("canceling statement due to statement timeout"), DatabaseUnavailable),
    (pg.AdminShutdown("terminating connection due to administrator command"), DatabaseUnavailable),
    (pg.ReadOnlySqlTransaction("cannot execute UPDATE in a read-only transaction"), DatabaseReadOnly),
    (pg.CannotConnectNow("the database system is starting up"), DatabaseUnavailable),
    (pg.TooManyConnections("too many clients"), DatabaseUnavailable),
    (pg.IdleInTransactionSessionTimeout("terminating connection due to idle-in-transaction timeout"),
     DatabaseUnavailable),
    # refused, and would be again: the job's
    (pg.CheckViolation('new row for relation "jobs" violates check constraint "x"'), InvalidJob),
    (pg.NotNullViolation("null value"), InvalidJob),
    (pg.InvalidTextRepresentation("invalid input syntax for type integer"), InvalidJob),
    (pg.NumericValueOutOfRange("value out of range"), InvalidJob),
    (pg.CharacterNotInRepertoire("invalid byte sequence"), InvalidJob),
    (pg.ProgramLimitExceeded("total size of jsonb array elements exceeds the maximum"), InvalidJob),
    (pg.RaiseException("refused by policy"), InvalidJob),
    (pg.AssertFailure("assertion failed"), InvalidJob),
    (pg.CardinalityViolation("more than one row returned by a subquery"), InvalidJob),
    (pg.TriggeredDataChangeViolation("tuple to be updated was already modified"), InvalidJob),
    (pg.WithCheckOptionViolation("new row violates check option"), InvalidJob),
    # a person has to act
    (pg.InsufficientPrivilege("permission denied for table jobs"), PrivilegeMissing),
    (pg.UndefinedTable('relation "jobs" does not exist'), SchemaMissing),
    (pg.UndefinedColumn('column "x" does not exist'), SchemaMissing),  # the schema older than the SDK
])
def test_each_driver_error_becomes_the_sdk_error_of_its_sqlstate(raised: Exception, expected: type) -> None:
    with pytest.raises(expected) as info, translated():
        raise raised
    assert info.value.__cause__ is raised
    assert str(raised) in str(info.value) or expected is SchemaMissing


def test_a_missing_grant_is_fatal_and_says_what_to_do() -> None:
    with pytest.raises(FatalError) as info, translated():
        raise pg.InsufficientPrivilege("permission denied for table job_dead_letters")
    assert isinstance(info.value, PrivilegeMissing)
    assert str(info.value).startswith("the database role lacks a privilege: permission denied for table "
                                      "job_dead_letters; grant it to this connection's role")


def test_a_statement_timeout_is_a_jobs_error_callers_can_catch_by_name() -> None:
    """StatementTimedOut lives with its siblings (consumer_sdk.jobs.errors, exported by
    consumer_sdk.jobs): a caller of accept or enqueue can answer "timed out"; still a
    DatabaseUnavailable (retried), and still importable from the seam, where it was defined."""
    from consumer_sdk.jobs import JobsError, StatementTimedOut, _db

    assert _db.StatementTimedOut is StatementTimedOut
    with pytest.raises(StatementTimedOut) as info, translated():
        raise pg.QueryCanceled("canceling statement due to statement timeout")
    assert isinstance(info.value, JobsError) and isinstance(info.value, DatabaseUnavailable)
    assert "pool_statement_timeout_s" in str(info.value)


@pytest.mark.parametrize("message", [
    "canceling statement due to user request",  # pg_cancel_backend, a client's cancel
    "Abbruch der Anweisung wegen Zeitüberschreitung",  # a statement timeout, lc_messages=de (see _db)
])
def test_any_other_cancel_is_a_plain_outage(message: str) -> None:
    from consumer_sdk.jobs import StatementTimedOut

    with pytest.raises(DatabaseUnavailable) as info, translated():
        raise pg.QueryCanceled(message)
    assert not isinstance(info.value, StatementTimedOut)
