"""Which errors of a handler's statements say the database failed, not the handler
(``StoreConnection.unavailable``): read by SQLSTATE class and exception type, no server
needed (the store has no connection here).  The integration side, with a real server:
tests/integration/sdk/test_sdk_handler_database_errors.py."""

from __future__ import annotations

import psycopg
import psycopg.errors
import pytest

from consumer_sdk.errors import DatabaseUnavailable, PermanentError
from consumer_sdk.store import PgInboxStore


def _store() -> PgInboxStore:
    def never() -> psycopg.Connection[object]:
        raise AssertionError("no connection is made to classify an error")

    return PgInboxStore(never)


@pytest.mark.parametrize("error", [
    psycopg.errors.AdminShutdown("terminating connection due to administrator command"),  # 57P01
    psycopg.errors.CrashShutdown("terminating connection because of crash of another server process"),
    psycopg.errors.CannotConnectNow("the database system is shutting down"),  # 57P03
    psycopg.errors.ConnectionFailure("connection failure"),  # class 08
    psycopg.errors.ConnectionException("connection exception"),
    psycopg.OperationalError("server closed the connection unexpectedly"),  # libpq's: no SQLSTATE
    psycopg.OperationalError("the connection is closed"),
    psycopg.InterfaceError("the connection is lost"),
], ids=lambda e: type(e).__name__ + ":" + str(e)[:20])
def test_a_lost_connection_under_the_handler_is_the_databases(error: psycopg.Error) -> None:
    unavailable = _store().unavailable(error)
    assert isinstance(unavailable, DatabaseUnavailable)
    assert str(unavailable).startswith("database unavailable: ")


def test_a_read_only_database_under_the_handler_is_waited_for() -> None:
    unavailable = _store().unavailable(psycopg.errors.ReadOnlySqlTransaction(
        "cannot execute INSERT in a read-only transaction"))
    assert isinstance(unavailable, DatabaseUnavailable)
    assert str(unavailable).startswith("the database is read-only (a standby, or a failover in progress)")


def test_a_driver_error_the_handler_wrapped_in_its_own_is_still_the_databases() -> None:
    try:
        try:
            raise psycopg.errors.AdminShutdown("terminating connection due to administrator command")
        except psycopg.Error as exc:
            raise RuntimeError("could not save the order") from exc
    except RuntimeError as wrapped:
        assert isinstance(_store().unavailable(wrapped), DatabaseUnavailable)


@pytest.mark.parametrize("error", [
    psycopg.errors.NotNullViolation("null value in column"),  # the handler's row
    psycopg.errors.UniqueViolation("duplicate key value"),
    psycopg.errors.UndefinedTable("relation does not exist"),  # the handler's SQL
    psycopg.errors.SyntaxError("syntax error at or near"),
    psycopg.errors.QueryCanceled("canceling statement due to statement timeout"),  # an OperationalError
    psycopg.errors.LockNotAvailable("could not obtain lock"),  # an OperationalError too
    psycopg.errors.SerializationFailure("could not serialize access"),
    PermanentError("no such customer"),
    ValueError("bad payload"),
], ids=lambda e: type(e).__name__)
def test_the_handlers_own_errors_stay_the_handlers(error: Exception) -> None:
    assert _store().unavailable(error) is None
