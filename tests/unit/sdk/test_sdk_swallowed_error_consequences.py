"""Which error the store keeps as the one that aborted a handler's transaction
(``StoreConnection.swallowed_error``), as the round trips on its connection end: no server
needed (the open transaction's connection is faked: only its status is read).  With a real
server, every way a handler runs a statement:
tests/integration/sdk/test_sdk_handler_caught_errors_paths.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import psycopg
import psycopg.errors
from psycopg.pq import TransactionStatus

from consumer_sdk.errors import TransactionConflict
from consumer_sdk.store import PgInboxStore


def _transaction(status: TransactionStatus) -> Any:
    """The open transaction's connection, as far as the store reads it."""
    return SimpleNamespace(pgconn=SimpleNamespace(transaction_status=status))


def _store() -> PgInboxStore:
    """A store in a transaction aborted by an error."""
    def never() -> psycopg.Connection[object]:
        raise AssertionError("no connection is made to follow the round trips")

    store = PgInboxStore(never)
    store._tx = _transaction(TransactionStatus.INERROR)
    return store


def test_a_statement_its_pipeline_skipped_does_not_hide_the_error_that_aborted_it() -> None:
    """``PipelineAborted`` has no SQLSTATE: kept, it passed for a lost connection
    (DatabaseUnavailable) instead of the deadlock the handler caught."""
    store = _store()
    deadlock = psycopg.errors.DeadlockDetected("deadlock detected")
    store._statement_ended(deadlock)
    store._statement_ended(psycopg.errors.PipelineAborted("pipeline aborted"))
    store._statement_ended(psycopg.errors.InFailedSqlTransaction("current transaction is aborted"))
    assert store.swallowed_error() is deadlock


def test_psycopgs_own_round_trips_after_the_error_do_not_clear_it_while_the_transaction_is_aborted() -> None:
    """A stream's cleanup after its error, a server-side cursor's close: they go through,
    and the transaction stays aborted by the error the handler caught.  Once it is sound
    again (a rollback to a savepoint), that error no longer counts."""
    store = _store()
    conflict = psycopg.errors.SerializationFailure("could not serialize access")
    store._statement_ended(conflict)
    store._statement_ended(None)
    assert store.swallowed_error() is conflict
    store._tx = _transaction(TransactionStatus.INTRANS)
    store._statement_ended(None)
    assert store.swallowed_error() is None


def test_a_skipped_statement_raised_from_the_handler_is_judged_by_the_error_it_caught() -> None:
    """The handler caught its pipeline's first error and let ``PipelineAborted`` out: the
    caught error says whose failure it was; with none seen, the handler's (it was judged a
    lost connection, for want of a SQLSTATE)."""
    store = _store()
    skipped = psycopg.errors.PipelineAborted("pipeline aborted")
    assert store.database_failure(skipped) is None
    store._statement_ended(psycopg.errors.SerializationFailure("could not serialize access"))
    judged = store.database_failure(skipped)
    assert isinstance(judged, TransactionConflict) and str(judged) == "transaction aborted: could not serialize access"
