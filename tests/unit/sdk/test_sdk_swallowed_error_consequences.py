"""Which error the store keeps as the one that aborted a handler's transaction
(``StoreConnection.swallowed_error``, read from the connection's ``_pg.FailedTrip``), as the
round trips on its connection end: no server needed (the open transaction's connection is
faked: only its status is read).  With a real
server, every way a handler runs a statement:
tests/integration/sdk/test_sdk_handler_caught_errors_paths.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import psycopg
import psycopg.errors
from psycopg.pq import TransactionStatus

from consumer_sdk import _pg
from consumer_sdk.errors import TransactionConflict
from consumer_sdk.store import PgInboxStore


def _transaction(status: TransactionStatus) -> Any:
    """The open transaction's connection, as far as its round trips' watcher reads it."""
    return SimpleNamespace(pgconn=SimpleNamespace(transaction_status=status))


def _store() -> tuple[PgInboxStore, _pg.FailedTrip]:
    """A store in a transaction aborted by an error, and its connection's round trips."""
    def never() -> psycopg.Connection[object]:
        raise AssertionError("no connection is made to follow the round trips")

    store = PgInboxStore(never)
    store._tx = _transaction(TransactionStatus.INERROR)
    store._failed = _pg.FailedTrip(store._tx)
    return store, store._failed


def test_a_statement_its_pipeline_skipped_does_not_hide_the_error_that_aborted_it() -> None:
    """``PipelineAborted`` has no SQLSTATE: kept, it passed for a lost connection
    (DatabaseUnavailable) instead of the deadlock the handler caught."""
    store, trips = _store()
    deadlock = psycopg.errors.DeadlockDetected("deadlock detected")
    trips.ended(deadlock)
    trips.ended(psycopg.errors.PipelineAborted("pipeline aborted"))
    trips.ended(psycopg.errors.InFailedSqlTransaction("current transaction is aborted"))
    assert store.swallowed_error() is deadlock


def test_psycopgs_own_round_trips_after_the_error_do_not_clear_it_while_the_transaction_is_aborted() -> None:
    """A stream's cleanup after its error, a server-side cursor's close: they go through,
    and the transaction stays aborted by the error the handler caught.  Once it is sound
    again (a rollback to a savepoint), that error no longer counts."""
    store, trips = _store()
    conflict = psycopg.errors.SerializationFailure("could not serialize access")
    trips.ended(conflict)
    trips.ended(None)
    assert store.swallowed_error() is conflict
    trips._conn = _transaction(TransactionStatus.INTRANS)
    trips.ended(None)
    assert store.swallowed_error() is None


def test_a_skipped_statement_raised_from_the_handler_is_judged_by_the_error_it_caught() -> None:
    """The handler caught its pipeline's first error and let ``PipelineAborted`` out: the
    caught error says whose failure it was; with none seen, the handler's (it was judged a
    lost connection, for want of a SQLSTATE)."""
    store, trips = _store()
    skipped = psycopg.errors.PipelineAborted("pipeline aborted")
    assert store.database_failure(skipped) is None
    trips.ended(psycopg.errors.SerializationFailure("could not serialize access"))
    judged = store.database_failure(skipped)
    assert isinstance(judged, TransactionConflict) and str(judged) == "transaction aborted: could not serialize access"


def test_an_error_outside_the_transaction_is_not_the_handlers() -> None:
    """The store's own round trips between transactions (a deferred COMMIT's, a claim's)
    pass through the same watcher: outside a transaction nothing is read from it."""
    store, trips = _store()
    trips.ended(psycopg.errors.SerializationFailure("could not serialize access"))
    store._failed = None
    assert store.swallowed_error() is None
