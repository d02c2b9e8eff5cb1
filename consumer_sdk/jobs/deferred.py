"""A fenced transaction's BEGIN and fence sent with the handler's first statement.

``JobContext.fenced_transaction`` needs, before the handler's first write, BEGIN and the
fence (the job row locked FOR KEY SHARE while this lease holds it).  Sent on their own
they cost a round trip of their own: a one-write transaction took three (BEGIN with the
fence, the write, COMMIT), the naive worker loop's count.  On the pool's own connections
(:class:`DeferringConnection`) the context only records the fence (:class:`Deferred`)
and the connection sends it with whatever comes first:

- the handler's first ``execute`` on a cursor of the connection's ``cursor_factory``
  (``conn.execute``, ``conn.cursor().execute``, text results, nothing prepared by
  request): BEGIN, the raising fence (migration 0012's ``outbox_jobs_fence``) and the
  statement go in one libpq pipeline (:func:`consumer_sdk.jobs.fenced.open_fenced`).
  When the lease is not held the fence raises, the server skips the statement, and the
  handler's ``execute`` raises :class:`~consumer_sdk.jobs.errors.LeaseLost`: nothing ran.
  Its result, row count and errors are the cursor's, as psycopg gives them;
- anything else that sends a statement (any cursor class, ``copy``, server-side cursors,
  ``conn.transaction()``): BEGIN and the fence first, in one round trip
  (``_start_query``, the path every psycopg cursor takes before sending, and
  ``transaction()``, which would otherwise begin a transaction of its own), then the
  statement as psycopg sends it.  In a psycopg pipeline (``conn.pipeline()``,
  ``executemany``) BEGIN and the raising fence are queued first, with a Sync, as
  psycopg begins a transaction there.

So a one-write fenced transaction costs two round trips: the write with BEGIN and the
fence, and COMMIT.  Nothing is ever sent outside the fence: the connection is in
autocommit, so a statement that went around it would commit on its own, which is why
the fallback sits in ``_start_query`` and not only in the cursor.  A connection of
another class (a ``connect=`` factory of the caller's) takes the three-round-trip way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any

import psycopg
import psycopg.errors
from psycopg import adapt, pq, sql
from psycopg.abc import PQGen

from consumer_sdk import _pg, _wire
from consumer_sdk.jobs import fenced
from consumer_sdk.jobs._db import q
from consumer_sdk.jobs.model import Lease
from outbox_core.spin import SpinningConnection

try:  # psycopg's prepared-statement cache, as its cursors consult it
    from psycopg._preparing import Prepare
except ImportError:  # pragma: no cover - another psycopg: INTERNALS is false
    Prepare = None  # type: ignore[assignment,misc]

_TEXT = pq.Format.TEXT

#: psycopg's internals this module relies on: that every cursor calls its connection's
#: ``_start_query`` before sending (what keeps a statement from going around the fence),
#: the cursor's own steps before sending (``_reset``, ``_convert_query``, ``_set_results``)
#: a pipeline's ``_sync_gen`` and the prepared-statement cache (``Prepare``).  Tested with psycopg 3.3
#: (tests/integration/jobs/test_jobs_deferred_fence.py sends a first statement every way a
#: handler can); on another release fenced transactions keep BEGIN and the fence in a round
#: trip of their own, as on a connection of another kind.
TESTED_PSYCOPG = (3, 3)
INTERNALS = (tuple(int(part) for part in psycopg.__version__.split(".")[:2]) == TESTED_PSYCOPG
             and all(hasattr(psycopg.Connection, name) for name in ("_start_query", "_exec_command"))
             and all(hasattr(psycopg.Cursor, name) for name in ("_reset", "_convert_query", "_set_results"))
             and hasattr(psycopg.Pipeline, "_sync_gen") and Prepare is not None)


class Deferred:
    """One fenced transaction's BEGIN and fence, recorded and not sent yet.  Taken once, by
    whichever statement comes first (the heartbeat's keepalive runs on another thread:
    :meth:`take` is atomic).  Once refused (the lease is not held) or failed before the
    transaction was open, every later statement of the block is refused too
    (:meth:`check`): the connection is in autocommit, and a handler that caught the error
    must not write around the fence."""

    PENDING, SENT, REFUSED, FAILED = "pending", "sent", "refused", "failed"

    def __init__(self, lease: Lease, now: datetime | None, refused: Callable[[], BaseException]) -> None:
        self.lease = lease
        self.now = now
        self._refused = refused  # the exception for "the lease is not held" (LeaseLost)
        self._lock = threading.Lock()
        self.state = self.PENDING

    @property
    def pending(self) -> bool:
        return self.state == self.PENDING

    def take(self) -> bool:
        """True for the one caller that sends it now."""
        with self._lock:
            if self.state != self.PENDING:
                return False
            self.state = self.SENT
        return True

    def refuse(self) -> BaseException:
        """The fence found the lease not held: the exception to raise (now and from then on)."""
        self.state = self.REFUSED
        return self._refused()

    def failed(self, conn: psycopg.Connection[Any]) -> None:
        """Sending it raised: when no transaction was left open, nothing more may run."""
        if self.state == self.SENT and conn.pgconn.transaction_status == pq.TransactionStatus.IDLE:
            self.state = self.FAILED

    def check(self) -> None:
        """Raise when the fence refused or the transaction could not begin."""
        if self.state == self.REFUSED:
            raise self._refused()
        if self.state == self.FAILED:
            raise psycopg.ProgrammingError("the fenced transaction could not begin (its error was raised "
                                           "before); no statement can run in it: leave the block")


class DeferringConnection(psycopg.Connection[Any]):
    """A psycopg connection that sends a :class:`Deferred` fence with its first statement
    (see the module).  Without one it is a plain psycopg connection."""

    #: Set by JobContext.fenced_transaction for its duration.
    deferred: Deferred | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cursor_factory = DeferringCursor

    def _start_query(self) -> PQGen[None]:
        deferred = self.deferred
        if deferred is not None:
            deferred.check()
            if deferred.take():
                try:
                    if self._pipeline is not None:
                        yield from _begin_in_pipeline_gen(self, deferred)
                    else:
                        yield from _begin_gen(self, deferred)
                except BaseException:
                    deferred.failed(self)
                    raise
        yield from super()._start_query()

    def transaction(self, *args: Any, **kwargs: Any) -> Any:
        # psycopg's Transaction begins a transaction of its own (and commits it) when it
        # finds none open: the fenced one must be open first, a savepoint in it.
        self.send_deferred()
        return super().transaction(*args, **kwargs)

    def send_deferred(self) -> None:
        """BEGIN and the deferred fence now, if no statement sent them yet."""
        deferred = self.deferred
        if deferred is not None and deferred.state != deferred.SENT:
            with self.lock:
                self.wait(self._start_query())  # or raises what check() raises


class SpinningDeferringConnection(DeferringConnection, SpinningConnection):
    """A :class:`DeferringConnection` whose waits poll first (``WorkerConfig.db_spin_us``)."""


class DeferringCursor(psycopg.Cursor[Any]):
    """The cursor of a :class:`DeferringConnection`: its first ``execute`` in a fenced
    transaction carries BEGIN and the fence (see the module)."""

    def execute(self, query: Any, params: Any = None, *, prepare: bool | None = None,
                binary: bool | None = None) -> DeferringCursor:
        conn = self.connection
        deferred = getattr(conn, "deferred", None)
        if (deferred is None or not deferred.pending or prepare or binary is not None or self.format != _TEXT
                or not isinstance(query, (str, bytes, sql.SQL, sql.Composed)) or not _wire.available(conn)):
            super().execute(query, params, prepare=prepare, binary=binary)  # _start_query: the fence first
            return self
        # What psycopg's execute does before sending (Cursor._start_query), less the BEGIN;
        # a conversion error leaves the fence pending.
        self._reset()
        self._last_query = None
        self._tx = adapt.Transformer(self)
        pgq = self._convert_query(query, params)
        # Prepared as psycopg's own execute would have it (its cache: after prepare_threshold
        # executions, and never behind a transaction pooler), recorded only once it ran.
        # Asked before the fence is taken: until then no other thread (the heartbeat's
        # keepalive) uses the connection, which shares the cache.
        prepared = conn._prepared
        prep, name = prepared.get(pgq, None)
        if prep is Prepare.NO:
            steps = [_wire.Step(pgq.query, pgq.params, pgq.types, pgq.formats)]
        else:
            steps = [_wire.Step(name, pgq.params, None, pgq.formats, prepared=True)]
            if prep is Prepare.SHOULD:
                steps.insert(0, _wire.Step(pgq.query, types=pgq.types, prepare_as=name))
        if not deferred.take():  # taken meanwhile (the keepalive skips a pending fence)
            super().execute(query, params)
            return self
        try:
            result = fenced.open_fenced(conn, deferred.lease, steps, now=deferred.now)
        except fenced.OneTripUnavailable:  # nothing stayed: the fence on its own, then the statement
            deferred.state = deferred.PENDING
            super().execute(query, params)
            return self
        except BaseException as exc:
            deferred.failed(conn)  # its own error leaves the transaction open and failed, as psycopg's
            if isinstance(exc, psycopg.Error):  # raised from the trip's results, after its wait
                _pg.failed_trip(conn).ended(exc)  # what a handler that catches it caught (aborted.py)
            raise
        if result is None:
            raise deferred.refuse()
        with conn.lock:  # the keepalive may run from now on
            key = prepared.maybe_add_to_cache(pgq, prep, name)
            if key is not None:
                prepared.validate(key, prep, name, [result])
            if prepared._to_flush:  # a statement the cache let go: DEALLOCATE it, as psycopg does
                conn.wait(prepared.maintain_gen(conn))
        self._query = pgq
        self._set_results([result])
        self._last_query = query
        return self


def _begin_gen(conn: psycopg.Connection[Any], deferred: Deferred) -> PQGen[None]:
    """BEGIN and the fence's lock (jobs.sql ``fenced_lock``, any migration) in one round trip,
    as a psycopg generator (the connection's lock held).  When the lease is not held, raises
    ``deferred.refuse()`` with the transaction left open (the fenced transaction rolls it
    back)."""
    lease = deferred.lease
    fence = _wire.bind(conn, q("fenced_lock"), {"id": lease.job_id, "worker": lease.worker,
                                                 "token": lease.token, "now": deferred.now})
    results = yield from _wire.send_all_gen(conn, [_wire.Step(_wire.BEGIN), fence])
    _wire.raise_first_error(conn, results)
    if results[1].ntuples == 0:
        raise deferred.refuse()


def _begin_in_pipeline_gen(conn: psycopg.Connection[Any], deferred: Deferred) -> PQGen[None]:
    """BEGIN and the raising fence in the psycopg pipeline the handler opened (``executemany``
    opens one too), then a Sync, as psycopg's own ``_start_query`` begins there: the fence
    is checked before the handler's statements are sent."""
    lease = deferred.lease
    fence = sql.SQL(q("fence_raise_in_pipeline")).format(
        id=sql.Literal(lease.job_id), token=sql.Literal(lease.token), now=sql.Literal(deferred.now))
    yield from conn._exec_command(_wire.BEGIN)
    yield from conn._exec_command(fence)
    pipeline = conn._pipeline
    assert pipeline is not None
    try:
        yield from pipeline._sync_gen()
    except psycopg.errors.RaiseException as exc:
        if not fenced.refused_by_fence(exc):
            raise
        raise deferred.refuse() from exc
