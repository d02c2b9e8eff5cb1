"""What a fenced transaction that ends aborted stands for: its handler caught a database error
inside ``fenced_transaction()`` and carried on.

The server aborted the transaction at that error, and COMMIT of an aborted transaction answers
ROLLBACK without an error (psycopg's ``commit()`` returns normally): the block ended as if it
had committed, the handler returned, and the pool recorded the job as succeeded with its
writes lost.  ``JobContext.fenced_transaction`` now reads the transaction's status before
COMMIT and raises what :func:`failure` makes of the error caught, as the connection's round
trips saw it (:func:`consumer_sdk._pg.failed_trip`):

- a conflict (SQLSTATE class 40: a serialization failure, a deadlock) is
  :class:`~consumer_sdk.errors.TransactionConflict`, and a read-only database (25006)
  :class:`~consumer_sdk.jobs.errors.DatabaseReadOnly`: the database's doing, retried as the
  pool retries them when the handler does not catch them (the jobs' ``_db`` translation);
- a statement psycopg had prepared and a transaction pooler lost is raised as it was caught:
  the pool gives the job back uncounted and turns psycopg's preparing off, as when uncaught;
- anything else (the handler's own SQL, a constraint, or an error the connection did not see)
  is :class:`~consumer_sdk.jobs.errors.FencedTransactionAborted`: the handler's failure, its
  attempt counted, its message readable in the dead letter.

``accept``'s ``on_accept`` hook (sync and asyncio) runs in accept's transaction the same way:
a hook that caught an error made accept return a run it had not stored; it raises too
(:func:`watch_hook`, :func:`check_hook`), its own failure a
:class:`~consumer_sdk.errors.HandlerTransactionFailed` (:data:`ON_ACCEPT`).
"""

from __future__ import annotations

from typing import Any

import psycopg
import psycopg.errors

from consumer_sdk import _pg
from consumer_sdk.errors import HandlerTransactionFailed, TransactionConflict
from consumer_sdk.jobs._db import first_line
from consumer_sdk.jobs.errors import DatabaseReadOnly, FencedTransactionAborted

_FENCED = "the handler caught a database error inside fenced_transaction() and carried on"
#: ``accept(on_accept=...)``'s hook runs in accept's transaction (the asyncio twin's: aio.py).
ON_ACCEPT = "on_accept caught a database error inside accept()'s transaction and carried on"
_ROLLED_BACK = "its transaction was rolled back, nothing written"


def failure(caught: psycopg.Error | None, *, what: str = _FENCED,
            own: type[Exception] = FencedTransactionAborted) -> Exception:
    """The exception to raise for a transaction found aborted at its end, raised from ``caught``:
    the error that aborted it, None when the connection did not see it (see the module).
    ``what`` says who caught it where, ``own`` is the exception of a failure of the caller's own."""
    if caught is None:
        return own(f"{what} (which error, the connection did not see); {_ROLLED_BACK}")
    if _pg.lost_prepared_statement(caught):
        return caught
    state = caught.sqlstate or ""
    said = f"{state} {first_line(caught)}" if state else f"{type(caught).__name__}: {first_line(caught)}"
    found: Exception
    if state.startswith("40"):
        found = TransactionConflict(f"transaction aborted: {said} ({what}; {_ROLLED_BACK})")
    elif isinstance(caught, psycopg.errors.ReadOnlySqlTransaction):
        found = DatabaseReadOnly(f"the database is read-only (a standby, or a failover in progress): {said}; "
                                 f"waiting for a writable primary ({what}; {_ROLLED_BACK})")
    else:
        found = own(f"{what}: {said}; {_ROLLED_BACK}")
    found.__cause__ = caught  # as `raise ... from caught`
    return found


def watch_hook(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> _pg.FailedTrip:
    """Before ``on_accept`` runs in accept's transaction: ``conn``'s round trips watched, no
    error seen yet (for :func:`check_hook`)."""
    trips = _pg.failed_trip(conn)
    trips.error = None
    return trips


def check_hook(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], trips: _pg.FailedTrip) -> None:
    """After ``on_accept`` returned, still inside accept's transaction: aborted, the hook caught
    the error that aborted it and carried on (its COMMIT would answer ROLLBACK, no error, and a
    run never stored be returned as accepted): raise what that error stands for, so that the
    block rolls back."""
    if _pg.aborted(conn):
        raise failure(trips.error, what=ON_ACCEPT, own=HandlerTransactionFailed)
