"""Which errors of a handler's statements say the database failed, not the handler
(``StoreConnection.database_failure``): read by SQLSTATE class and exception type, no server
needed (the store has no connection here).  The integration side, with a real server:
tests/integration/sdk/test_sdk_handler_database_errors.py."""

from __future__ import annotations

from types import SimpleNamespace

import psycopg
import psycopg.errors
import pytest

from consumer_sdk import _pg
from consumer_sdk.errors import DatabaseUnavailable, PermanentError, TransactionConflict
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
    unavailable = _store().database_failure(error)
    assert isinstance(unavailable, DatabaseUnavailable)
    assert str(unavailable).startswith("database unavailable: ")


def test_a_read_only_database_under_the_handler_is_waited_for() -> None:
    unavailable = _store().database_failure(psycopg.errors.ReadOnlySqlTransaction(
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
        assert isinstance(_store().database_failure(wrapped), DatabaseUnavailable)


@pytest.mark.parametrize("error", [
    psycopg.errors.NotNullViolation("null value in column"),  # the handler's row
    psycopg.errors.UniqueViolation("duplicate key value"),
    psycopg.errors.UndefinedTable("relation does not exist"),  # the handler's SQL
    psycopg.errors.SyntaxError("syntax error at or near"),
    psycopg.errors.QueryCanceled("canceling statement due to statement timeout"),  # an OperationalError
    psycopg.errors.LockNotAvailable("could not obtain lock"),  # an OperationalError too
    PermanentError("no such customer"),
    ValueError("bad payload"),
], ids=lambda e: type(e).__name__)
def test_the_handlers_own_errors_stay_the_handlers(error: Exception) -> None:
    assert _store().database_failure(error) is None


@pytest.mark.parametrize("error", [
    psycopg.errors.SerializationFailure("could not serialize access due to concurrent update"),  # 40001
    psycopg.errors.DeadlockDetected("deadlock detected"),  # 40P01
    psycopg.errors.TransactionRollback("transaction rollback"),  # 40000
], ids=lambda e: type(e).__name__)
def test_a_transaction_the_server_aborted_for_a_conflict_is_run_again_not_judged(error: Exception) -> None:
    """Class 40: PostgreSQL asks the client to run the transaction again; before, a
    serialization failure or a deadlock under the handler counted its attempts and
    dead-lettered the message."""
    conflict = _store().database_failure(error)
    assert isinstance(conflict, TransactionConflict)
    assert str(conflict) == f"transaction aborted: {error}"


@pytest.mark.parametrize("error", [
    psycopg.errors.SerializationFailure("could not serialize access due to concurrent update"),
    psycopg.errors.DeadlockDetected("deadlock detected"),
], ids=lambda e: type(e).__name__)
def test_the_stores_own_statement_meeting_a_conflict_keeps_its_connection(error: Exception) -> None:
    """The store's own statement (a claim deadlocking with another member's) is a
    TransactionConflict on the same session; before, it was "database unavailable" and the
    connection was dropped."""
    store = _store()
    dropped: list[bool] = []
    store.reset = lambda: dropped.append(True)  # type: ignore[method-assign]
    with pytest.raises(TransactionConflict, match="^transaction aborted: "):
        with store.translated():
            raise error
    assert dropped == []


def test_a_statement_refused_in_an_aborted_transaction_is_judged_by_the_error_the_handler_caught() -> None:
    """A handler caught the error that aborted its transaction and went on: its next statement
    meets 25P02, which says nothing of whose failure it was; the caught error does (the store
    saw it go by: StoreConnection.swallowed_error)."""
    store = _store()
    refused = psycopg.errors.InFailedSqlTransaction("current transaction is aborted, commands ignored until "
                                                    "end of transaction block")
    assert store.database_failure(refused) is None  # nothing seen: the handler's failure
    store._failed = _pg.FailedTrip(SimpleNamespace(pgconn=None))  # its error is all that is read here
    store._failed.error = psycopg.errors.DeadlockDetected("deadlock detected")
    assert str(store.database_failure(refused)) == "transaction aborted: deadlock detected"
    assert isinstance(store.database_failure(refused), TransactionConflict)
    store._failed.error = psycopg.errors.ReadOnlySqlTransaction("cannot execute INSERT in a read-only transaction")
    assert isinstance(store.database_failure(refused), DatabaseUnavailable)
    store._failed.error = psycopg.errors.NotNullViolation("null value in column")
    assert store.database_failure(refused) is None  # the handler's own statement: the policy's
