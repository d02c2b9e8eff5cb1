"""A job's fenced write in one round trip (``JobContext.fenced_execute``, ``fenced_statements``).

BEGIN, migration 0012's raising fence (``outbox_jobs_fence``: the job row locked FOR KEY
SHARE while this lease holds it, else an error), the statement and COMMIT go in one
libpq pipeline (:mod:`consumer_sdk._wire`).  When the lease is not held the fence
raises, the server skips the statement and the COMMIT up to the pipeline's Sync, and
nothing is written.  :func:`open_fenced` sends BEGIN, the fence and a transaction's first
statement the same way, the transaction left open (:mod:`consumer_sdk.jobs.deferred`:
two round trips for a handler's one-write transaction);
:func:`consumer_sdk.jobs.queue.fence_begin` is the fence on its own, for a connection of
another kind (three).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg
import psycopg.errors
from psycopg import pq

from consumer_sdk import _wire
from consumer_sdk.jobs._db import ConnectionT, first_line, q
from consumer_sdk.jobs.model import Lease

#: Connections known to hold the prepared raising fence (see fenced_execute); and those
#: whose database has no outbox_jobs_fence yet (migration 0012 not applied): they take
#: the three-round-trip path.
_RAISING_FENCE_PREPARED: weakref.WeakSet[ConnectionT] = weakref.WeakSet()
_NO_RAISING_FENCE: weakref.WeakSet[ConnectionT] = weakref.WeakSet()
#: The prepared raising fence's name, as ``fence_raise_prepare`` in jobs.sql creates it.
RAISING_FENCE_STATEMENT = b"outbox_jobs_fence_v3"
#: After the prepared fence was gone this many times in a row (prepared again each time, and
#: gone again before a write could use it: a pooler that moves sessions between servers),
#: the connection takes the three-round-trip path for good.  A single loss (DISCARD ALL)
#: costs a ROLLBACK and a PREPARE more, then it is prepared again.
PREPARED_LOSSES_MAX = 3
_LOSSES: weakref.WeakKeyDictionary[ConnectionT, int] = weakref.WeakKeyDictionary()


#: How outbox_jobs_fence's refusal ends (migration 0012's RAISE EXCEPTION).
FENCE_REFUSAL = "does not hold it any more"


class OneTripUnavailable(Exception):
    """The connection cannot keep the prepared fence (see PREPARED_LOSSES_MAX) or the
    database lost ``outbox_jobs_fence``: nothing was written; use a fenced transaction."""


def one_trip_fence(conn: ConnectionT) -> bool:
    """True when :func:`fenced_execute` can run on ``conn``: libpq's pipeline and psycopg's
    internals are there (:func:`consumer_sdk._wire.available`), and the database has
    ``outbox_jobs_fence`` (migration 0012).  The first call on a connection prepares the
    fence (one round trip, once)."""
    if conn in _NO_RAISING_FENCE or not _wire.available(conn):
        return False
    if conn not in _RAISING_FENCE_PREPARED:
        try:
            _wire.prepare(conn, q("fence_raise_prepare").encode())
        except psycopg.errors.UndefinedFunction:
            _NO_RAISING_FENCE.add(conn)
            return False
        _RAISING_FENCE_PREPARED.add(conn)
    return True


def fenced_execute(conn: ConnectionT, lease: Lease, query: Any, params: Any = None, *,
                   now: datetime | None = None) -> int | None:
    """BEGIN, the raising fence, ``query`` and COMMIT in one round trip (one libpq pipeline);
    returns the statement's row count, or None when ``lease`` does not hold the job (then
    nothing was written).  See :func:`fenced_statements`."""
    counts = fenced_statements(conn, lease, [(query, params)], now=now)
    return None if counts is None else counts[0]


def fenced_statements(conn: ConnectionT, lease: Lease, statements: Sequence[tuple[Any, Any]], *,
                      now: datetime | None = None) -> list[int] | None:
    """BEGIN, the raising fence, ``statements`` (``(query, params)`` pairs) and COMMIT in one
    round trip (one libpq pipeline); returns each statement's row count, or None when
    ``lease`` does not hold the job (then nothing was written).  Check
    :func:`one_trip_fence` first; :class:`OneTripUnavailable` (nothing written) says to go
    the three-round-trip way from now on.

    The fence locks the job row FOR KEY SHARE before the statements run, as
    :func:`consumer_sdk.jobs.queue.fence_begin` does; when it raises, the server skips the
    statements and the COMMIT.  Any failure leaves no transaction open (it is rolled back
    here).  A statement's own error, or the COMMIT's, is raised as psycopg raises it
    (nothing written); so are driver errors (the caller translates them).
    """
    binder = _wire.transformer(conn) if len(statements) > 1 else None  # one cursor's dumpers for all
    steps = [_wire.bind(conn, query, params, transformer=binder) for query, params in statements]
    results = _trip(conn, lease, steps, now=now, commit=True)
    return None if results is None else [result.command_tuples or 0 for result in results]


def open_fenced(conn: ConnectionT, lease: Lease, steps: Sequence[_wire.Step], *,
                now: datetime | None = None) -> pq.abc.PGresult | None:
    """BEGIN, the raising fence and ``steps`` (a statement bound as :func:`consumer_sdk._wire.bind`
    binds it, perhaps its PREPARE before it) in one round trip, the transaction left open
    for more statements and the caller's COMMIT: :mod:`consumer_sdk.jobs.deferred`, a
    fenced transaction's first statement.  Returns the last step's result, or None when
    ``lease`` does not hold the job (nothing written, no transaction left open).  The
    statement's own error is raised as psycopg raises it, the transaction left open and
    failed, as psycopg leaves it (the caller rolls back).  :class:`OneTripUnavailable` as
    :func:`fenced_statements`."""
    results = _trip(conn, lease, steps, now=now, commit=False)
    return None if results is None else results[-1]


def _trip(conn: ConnectionT, lease: Lease, steps: Sequence[_wire.Step], *, now: datetime | None,
          commit: bool) -> list[pq.abc.PGresult] | None:
    """BEGIN, the raising fence, ``steps`` and (``commit``) COMMIT in one round trip; the
    results of ``steps``, or None when the fence refused (see the callers)."""
    fence = [b"%d" % lease.job_id, b"%d" % lease.token, None if now is None else now.isoformat().encode()]
    tail = [_wire.Step(_wire.COMMIT)] if commit else []
    for _attempt in range(2):
        results = _wire.send_all(conn, [_wire.Step(_wire.BEGIN), _wire.Step(RAISING_FENCE_STATEMENT, fence, prepared=True),
                                        *steps, *tail])
        fenced = results[1]
        if fenced.status != pq.ExecStatus.FATAL_ERROR:
            _LOSSES.pop(conn, None)
        if not any(_wire.failed(result) for result in results):
            return results[2:2 + len(steps)]
        if fenced.status == pq.ExecStatus.FATAL_ERROR:
            _end_failed(conn)
            error = psycopg.errors.error_from_result(fenced, encoding=conn.info.encoding)
            if isinstance(error, psycopg.errors.RaiseException):
                return None  # outbox_jobs_fence: not held
            if isinstance(error, psycopg.errors.InvalidSqlStatementName):  # DISCARD ALL, another session
                _RAISING_FENCE_PREPARED.discard(conn)
                losses = _LOSSES[conn] = _LOSSES.get(conn, 0) + 1
                if losses >= PREPARED_LOSSES_MAX:
                    _NO_RAISING_FENCE.add(conn)
                if not one_trip_fence(conn):
                    raise OneTripUnavailable(first_line(error))
                continue
            _wire.raise_first_error(conn, results)
        if commit:
            _end_failed(conn)  # else the caller's transaction stays open and failed, as psycopg leaves it
        _wire.raise_first_error(conn, results)
    raise OneTripUnavailable("the prepared fence was gone twice in a row")


def refused_by_fence(exc: BaseException) -> bool:
    """``exc`` is ``outbox_jobs_fence``'s refusal (migration 0012: the lease is not held)."""
    return (isinstance(exc, psycopg.errors.RaiseException)
            and (exc.diag.message_primary or "").endswith(FENCE_REFUSAL))


def forget_prepared(conn: ConnectionT) -> None:
    """psycopg's ``rollback()`` on ``conn`` may have sent DEALLOCATE ALL (see :func:`_end_failed`):
    prepare the raising fence again before its next use, without counting a loss."""
    _RAISING_FENCE_PREPARED.discard(conn)


def _end_failed(conn: ConnectionT) -> None:
    """Roll back what a failed pipeline left open (BEGIN went through), below psycopg as the
    trip went: psycopg's ``rollback()`` answers with DEALLOCATE ALL once it holds prepared
    statements of its own (a worker connection's claims, run often enough), which took the
    prepared fence along (prepared again on the next write, and counted as a loss: after
    PREPARED_LOSSES_MAX failed writes in a row, the connection left the one trip for good)."""
    if not conn.closed:
        _wire.roll_back(conn)
