"""Which handler failures are the database connection breaking (the attempt is given back, not
counted: consumer_sdk.jobs.executor) and which are the job's own (counted as before), and the
pool's bound on them (WorkerConfig.max_interruptions)."""

from __future__ import annotations

from typing import Any

import psycopg
import psycopg.errors
import pytest

from consumer_sdk.errors import DatabaseUnavailable
from consumer_sdk.jobs import WorkerConfig
from consumer_sdk.jobs.errors import InvalidJob
from consumer_sdk.jobs.retry import connection_broke, interrupted_note


class _Conn:
    """What connection_broke reads of the job's connection."""

    def __init__(self, *, closed: bool = False, broken: bool = False) -> None:
        self.closed, self.broken = closed, broken


ALIVE, BROKEN, CLOSED = _Conn(), _Conn(broken=True), _Conn(closed=True)


@pytest.mark.parametrize("exc", [
    psycopg.errors.AdminShutdown("terminating connection due to administrator command"),  # 57P01
    psycopg.errors.CrashShutdown("terminating connection because of crash of another server process"),
    psycopg.errors.CannotConnectNow("the database system is starting up"),  # 57P03
    psycopg.errors.lookup("08006")("connection failure"),
    psycopg.errors.lookup("08003")("connection does not exist"),
], ids=lambda exc: type(exc).__name__)
def test_a_session_the_server_ended_is_the_connection_breaking(exc: Exception) -> None:
    assert connection_broke(exc, BROKEN)
    assert connection_broke(exc, ALIVE)  # the handler's other connection (its SQLSTATE says so)


@pytest.mark.parametrize("exc", [
    psycopg.OperationalError("server closed the connection unexpectedly"),
    psycopg.OperationalError("consuming input failed: EOF detected"),
    psycopg.InterfaceError("the connection is closed"),
], ids=str)
def test_a_driver_error_without_sqlstate_breaks_the_connection_only_when_the_jobs_is_dead(exc: Exception) -> None:
    assert connection_broke(exc, BROKEN)
    assert connection_broke(exc, CLOSED)
    assert not connection_broke(exc, ALIVE)  # e.g. the handler's own connection to elsewhere was refused


@pytest.mark.parametrize("exc", [
    psycopg.errors.QueryCanceled("canceling statement due to statement timeout"),  # 57014
    psycopg.errors.LockNotAvailable("canceling statement due to lock timeout"),  # 55P03
    psycopg.errors.UniqueViolation("duplicate key value"),
    ValueError("the job's own bug"),
    DatabaseUnavailable("database unavailable: too many clients"),
], ids=lambda exc: type(exc).__name__)
def test_the_jobs_own_failures_are_not_the_connection_breaking(exc: Exception) -> None:
    assert not connection_broke(exc, ALIVE)


def test_a_statement_cancelled_on_a_connection_that_broke_since_is_still_the_jobs() -> None:
    assert not connection_broke(psycopg.errors.QueryCanceled("statement timeout"), BROKEN)
    assert not connection_broke(psycopg.errors.LockNotAvailable("lock timeout"), CLOSED)
    assert not connection_broke(ValueError("the job's own bug"), BROKEN)


def _raised(inner: BaseException, *, explicit: bool) -> BaseException:
    """A RuntimeError the handler raised from ``inner`` (``raise ... from``) or while handling it."""
    try:
        try:
            raise inner
        except BaseException as exc:
            if explicit:
                raise RuntimeError("the handler's words") from exc
            raise RuntimeError("the handler's words")  # noqa: B904 - the implicit chain is the case
    except RuntimeError as raised:
        return raised
    raise AssertionError("unreachable")


@pytest.mark.parametrize("explicit", [True, False], ids=["raise_from", "raised_while_handling"])
def test_a_handler_that_wraps_the_drivers_error_is_read_through(explicit: bool) -> None:
    wrapped = _raised(psycopg.errors.AdminShutdown("terminating connection"), explicit=explicit)
    assert connection_broke(wrapped, BROKEN)
    own = _raised(ValueError("bad input"), explicit=explicit)
    assert not connection_broke(own, BROKEN)


def test_a_chain_that_loops_ends() -> None:
    first, second = RuntimeError("a"), RuntimeError("b")
    first.__cause__, second.__cause__ = second, first
    assert not connection_broke(first, BROKEN)


def test_the_note_says_how_many_times_and_the_limit() -> None:
    assert interrupted_note(1, 1) == (" (the database connection broke under this job's attempts once: past the "
                                      "pool's max_interruptions=1, each such attempt counts)")
    assert "11 times" in interrupted_note(11, 10) and "max_interruptions=10" in interrupted_note(11, 10)


def test_max_interruptions_defaults_to_ten_and_zero_turns_it_off() -> None:
    assert WorkerConfig(dsn="postgresql://localhost/db").max_interruptions == 10
    assert WorkerConfig(dsn="postgresql://localhost/db", max_interruptions=0).max_interruptions == 0


@pytest.mark.parametrize("value", [-1, 10_001, 2.0, True, "10", None])
def test_max_interruptions_is_checked(value: Any) -> None:
    with pytest.raises(InvalidJob, match=r"max_interruptions must be an integer from 0 to 10,000"):
        WorkerConfig(dsn="postgresql://localhost/db", max_interruptions=value)
