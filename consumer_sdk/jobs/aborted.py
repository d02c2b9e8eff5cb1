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
"""

from __future__ import annotations

import psycopg
import psycopg.errors

from consumer_sdk import _pg
from consumer_sdk.errors import TransactionConflict
from consumer_sdk.jobs._db import first_line
from consumer_sdk.jobs.errors import DatabaseReadOnly, FencedTransactionAborted

_CAUGHT = "the handler caught a database error inside fenced_transaction() and carried on"
_ROLLED_BACK = "its transaction was rolled back, nothing written"


def failure(caught: psycopg.Error | None) -> Exception:
    """The exception for a fenced transaction found aborted at its end; ``caught`` is the error
    that aborted it, None when the connection did not see it (see the module)."""
    if caught is None:
        return FencedTransactionAborted(f"{_CAUGHT} (which error, the connection did not see); {_ROLLED_BACK}")
    if _pg.lost_prepared_statement(caught):
        return caught
    state = caught.sqlstate or ""
    said = f"{state} {first_line(caught)}" if state else f"{type(caught).__name__}: {first_line(caught)}"
    if state.startswith("40"):
        return TransactionConflict(f"transaction aborted: {said} ({_CAUGHT}; {_ROLLED_BACK})")
    if isinstance(caught, psycopg.errors.ReadOnlySqlTransaction):
        return DatabaseReadOnly(f"the database is read-only (a standby, or a failover in progress): {said}; "
                                f"waiting for a writable primary ({_CAUGHT}; {_ROLLED_BACK})")
    return FencedTransactionAborted(f"{_CAUGHT}: {said}; {_ROLLED_BACK}")
