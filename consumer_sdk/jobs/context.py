"""What a handler gets: the job, its connection, cooperative cancellation and fenced writes.

Ownership: the worker pool creates one :class:`JobContext` per attempt and owns
the connection (``ctx.conn``, autocommit); the handler may read with it freely
and must write through :meth:`JobContext.fenced_transaction` (or
:meth:`JobContext.put_result`), which commits only while the worker still holds
the job's lease.  Writes made outside a fenced transaction are not fenced.

Cancellation is cooperative: when the heartbeat finds the lease lost (or the
run cancelled, or the pool stopping), ``ctx.cancelled`` becomes True and
:meth:`check`, :meth:`sleep` and :meth:`fenced_transaction` raise
:class:`~consumer_sdk.jobs.errors.LeaseLost`.  A handler that calls nothing of
these is not interrupted, but its fenced writes are still refused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import psycopg
import psycopg.errors
from psycopg import pq

from consumer_sdk import _pg
from consumer_sdk.errors import DatabaseUnavailable
from consumer_sdk.jobs import aborted, fenced, queue
from consumer_sdk.jobs import deferred as deferred_fence
from consumer_sdk.jobs._db import ConnectionT, first_line, q
from consumer_sdk.jobs.deferred import Deferred, DeferringConnection
from consumer_sdk.jobs.errors import LeaseLost
from consumer_sdk.jobs.model import ClaimedJob, Lease

_MESSAGES = {
    "lease_lost": "the job's lease was lost (expired and taken over, or finished elsewhere)",
    "lease_unconfirmed": "the lease could not be renewed before it ran out",
    "cancelled": "the run was cancelled by its owner",
    "shutdown": "the worker pool is stopping; the job is given back",
    "fence_ended": "the server ended the fenced transaction (idle past the lease without renewal)",
    "timed_out": "the handler ran past the pool's handler_timeout_s; the pool wrote the attempt's failure",
}


class JobContext:
    """One attempt of one job, as its handler sees it.  Thread-safe: the heartbeat cancels it."""

    def __init__(self, job: ClaimedJob, conn: ConnectionT | None = None, *, deadline: float,
                 db_now: Callable[[], datetime | None] = lambda: None) -> None:
        self.job = job
        self._conn = conn
        self._reconnect: Callable[[], ConnectionT] | None = None
        self.deadline = deadline  # monotonic seconds until which the lease is trusted locally
        self._db_now = db_now
        self._reason: str | None = None  # set once, under _lock: the attempt is cancelled
        self._woken: threading.Event | None = None  # for sleep(); made by its first call
        self._lock = threading.Lock()
        self._fenced_depth = 0
        #: The handler succeeded and the pool writes the completion with its next round.
        self.completing = False
        #: The attempt's outcome was sent under its lease (the executor's write, or the round
        #: that carries its completion) and may have committed: that write, not the heartbeat,
        #: says whether the lease held (see :mod:`consumer_sdk.jobs.heartbeat`).
        self.ending = False
        #: ``time.monotonic()`` when its handler was called, None before and after it ran
        #: (the executor sets it): the pool's gauge of the oldest running attempt reads it.
        self.running_since: float | None = None
        #: ``job_running_long`` was logged for this attempt (once each).
        self.long_reported = False

    @property
    def conn(self) -> ConnectionT:
        """The connection this attempt runs on (autocommit); owned by the pool."""
        if self._conn is None:
            raise RuntimeError("this JobContext has no connection yet")
        return self._conn

    def bind(self, conn: ConnectionT, *, reconnect: Callable[[], ConnectionT] | None = None) -> None:
        """Give the context its connection (the executor that runs it does, before the handler);
        ``reconnect`` makes a new one when it broke (the executor's slot: see :meth:`reconnect`)."""
        self._conn = conn
        self._reconnect = reconnect

    def reconnect(self) -> ConnectionT:
        """The attempt's connection broke: close it and bind a new one (``bind``'s ``reconnect``),
        for the outcome's write.  :class:`~consumer_sdk.errors.DatabaseUnavailable` when none
        can be made."""
        if self._conn is not None:
            try:
                self._conn.close()
            except psycopg.Error:
                pass
        if self._reconnect is None:
            raise DatabaseUnavailable("database unavailable: the job's connection broke")
        self._conn = self._reconnect()
        return self._conn

    # -- identity -----------------------------------------------------------------------

    @property
    def lease(self) -> Lease:
        return self.job.lease

    @property
    def payload(self) -> Any:
        """The job's payload (a run's goal, as accepted)."""
        return self.job.payload

    @property
    def activation(self) -> Any:
        """The recorded activation's payload when the job resumed after waiting, else None."""
        return self.job.activation

    @property
    def idempotency_key(self) -> str:
        """Unique to this attempt (job id and lease token): pass it to external calls.

        A stale attempt and its successor never share it, so a receiver that keeps
        keys can tell them apart; for an effect that must happen once across all
        attempts, use :meth:`effect_key`.
        """
        return f"job-{self.job.id}-attempt-{self.job.token}"

    def effect_key(self, name: str) -> str:
        """Stable across attempts: the same for every retry or takeover of this job."""
        return f"job-{self.job.id}-{name}"

    # -- cancellation -------------------------------------------------------------------

    @property
    def cancelled(self) -> bool:
        return self._reason is not None

    @property
    def cancel_reason(self) -> str | None:
        return self._reason

    def cancel(self, reason: str) -> bool:
        """Ask the handler to stop (first reason wins); True when this call cancelled it."""
        with self._lock:
            if self._reason is not None:
                return False
            self._reason = reason
            woken = self._woken
        if woken is not None:
            woken.set()
        return True

    def time_out(self) -> bool:
        """Cancel the attempt as ``timed_out`` if its handler still runs and nothing else
        cancelled it: True when this call did (then the pool, not the handler, writes the
        attempt's outcome).  Atomic with :meth:`handler_returned`: one of them wins."""
        with self._lock:
            if self._reason is not None or self.running_since is None:
                return False
            self._reason = "timed_out"
            woken = self._woken
        if woken is not None:
            woken.set()
        return True

    def handler_returned(self) -> None:
        """The handler returned or raised (the executor calls it): it can no longer time out."""
        with self._lock:
            self.running_since = None

    def check(self) -> None:
        """Raise :class:`LeaseLost` when the attempt was cancelled; call it between steps."""
        if self._reason is not None:
            raise self._lease_lost()

    def sleep(self, seconds: float) -> None:
        """Wait up to ``seconds``, waking at once on cancellation (then raise LeaseLost)."""
        with self._lock:
            woken = self._woken = self._woken or threading.Event()
            if self._reason is not None:
                woken.set()
        woken.wait(max(0.0, seconds))
        self.check()

    # -- fenced writes ------------------------------------------------------------------

    @contextmanager
    def fenced_transaction(self) -> Iterator[ConnectionT]:
        """A transaction on ``ctx.conn`` that commits only while this attempt holds the lease.

        Its first statement locks the job row with owner, token, status and lease in the
        WHERE clause (FOR KEY SHARE: no takeover or cancellation can slip in before the
        commit).  On the pool's own connections BEGIN and that lock go with the handler's
        first statement, in its round trip (:mod:`consumer_sdk.jobs.deferred`: a one-write
        transaction costs two round trips, the write and COMMIT), and that statement
        raises LeaseLost, having run nothing, when the lease is not held; on a connection
        of another kind they go in a round trip of their own, at the start of the block.
        No row: rolls back and raises LeaseLost.  An exception in the block rolls back and
        propagates; so does a block whose handler caught a database error and carried on,
        its transaction aborted by the server: rolled back, it raises what that error stands
        for (:mod:`consumer_sdk.jobs.aborted`), never a silent success.  A broken connection
        raises LeaseLost too: authority cannot be proven any more (if it broke during the
        commit, the outcome is unknown, which writes by key make harmless).  A block that
        sends no statement sends nothing.
        """
        self.check()
        conn = self.conn
        trips = _pg.failed_trip(conn)  # the error a handler catches, for an aborted end (aborted.py)
        if self._fenced_depth == 0:
            trips.error = None
        deferred = self._defer(conn)
        rollback = _rollback if deferred is None else _rollback_deferred
        try:
            # BEGIN and the fence's lock in one round trip (one simple query, see
            # queue.fence_begin), or deferred to the first statement; then the handler's
            # statements; then COMMIT, or ROLLBACK on any exception.
            held = deferred is not None or queue.fence_begin(conn, self.lease, now=self._db_now())
            try:
                if not held:
                    self.cancel("lease_lost")
                    self.check()
                self._fenced_depth += 1
                try:
                    yield conn
                finally:
                    self._fenced_depth -= 1
            except BaseException:
                rollback(conn)
                raise
            if deferred is not None:
                deferred.check()  # refused or failed, and the handler swallowed it: raised here again
                if deferred.take():  # no statement was sent: nothing to commit
                    return
            if _pg.aborted(conn):
                # The handler caught the error that aborted it and carried on: COMMIT would
                # answer ROLLBACK, no error, and the attempt pass for a success.
                caught = trips.error  # before the rollback's round trip forgets it
                rollback(conn)
                raise aborted.failure(caught)
            conn.commit()
        except psycopg.Error as exc:
            rollback(conn)  # BEGIN went through even when the fence's statement failed
            translated = self._lost_or(exc)
            if translated is exc:
                raise
            raise translated from exc
        finally:
            if deferred is not None:
                deferred.take()
                conn.deferred = None  # type: ignore[attr-defined]  # a DeferringConnection (_defer)

    def _defer(self, conn: ConnectionT) -> Deferred | None:
        """The fence recorded on ``conn`` for its first statement to send
        (:mod:`consumer_sdk.jobs.deferred`), or None where it goes at once: a connection of
        another kind, a transaction already open, no migration 0012 or no pipeline mode."""
        if not (isinstance(conn, DeferringConnection) and deferred_fence.INTERNALS and self._fenced_depth == 0
                and conn.pgconn.transaction_status == pq.TransactionStatus.IDLE):
            return None
        try:
            if not fenced.one_trip_fence(conn):
                return None
        except psycopg.Error as exc:
            raise self._lost_or(exc) from exc
        deferred = conn.deferred = Deferred(self.lease, self._db_now(), self._refused)
        return deferred

    def _refused(self) -> BaseException:
        """The fence found the lease not held: the attempt is cancelled, LeaseLost to raise."""
        self.cancel("lease_lost")  # the first reason wins
        return self._lease_lost()

    def _lease_lost(self, cause: str = "") -> LeaseLost:
        """LeaseLost for the attempt's cancellation reason (lease_lost when none yet)."""
        reason = self._reason or "lease_lost"
        return LeaseLost(f"job {self.job.id}: {_MESSAGES.get(reason, reason)}{cause}", reason=reason)

    def fenced_execute(self, query: Any, params: Any = None) -> int:
        """Run one writing statement in a fenced transaction of its own, in one round trip.

        ``query`` and ``params`` are what ``conn.execute`` takes (one statement: a CTE can
        write several tables).  BEGIN, the fence, the statement and COMMIT go to the server
        together: the fence locks the job row as :meth:`fenced_transaction`'s does and, when
        this attempt no longer holds the lease, raises there, so the statement and the
        COMMIT are skipped.  Returns the statement's row count.  Raises :class:`LeaseLost`
        (nothing written), or the statement's own error (nothing written).  Inside an open
        :meth:`fenced_transaction` it runs in that transaction.

        It costs a third of :meth:`fenced_transaction`'s round trips (one instead of BEGIN
        with the fence, the statement, COMMIT): use it when the write is one statement and
        its rows are not read back.  On a database without migration 0012, a libpq without
        pipeline mode, or a connection that cannot keep a prepared statement (a pooler that
        moves sessions between servers), it runs as ``fenced_transaction`` plus ``execute``.
        """
        return self.fenced_statements([(query, params)])[0]

    def fenced_statements(self, statements: Sequence[tuple[Any, Any]]) -> list[int]:
        """:meth:`fenced_execute` for several writing statements, ``[(query, params), ...]``,
        in one fenced transaction and one round trip; returns each one's row count.  The
        first that fails is raised and nothing is written; so is :class:`LeaseLost`."""
        if self._fenced_depth > 0:
            return [self.conn.execute(query, params).rowcount for query, params in statements]
        self.check()
        conn = self.conn
        try:
            one_trip = fenced.one_trip_fence(conn)
            if one_trip:
                counts = fenced.fenced_statements(conn, self.lease, statements, now=self._db_now())
        except fenced.OneTripUnavailable:
            one_trip = False  # a pooler that moves sessions, or the function dropped: nothing written
        except psycopg.Error as exc:
            raise self._lost_or(exc) from exc
        if not one_trip:
            with self.fenced_transaction() as tx:
                return [tx.execute(query, params).rowcount for query, params in statements]
        if counts is None:
            self.cancel("lease_lost")
            self.check()
        return counts or [0] * len(statements)

    def _lost_or(self, exc: psycopg.Error) -> Exception:
        """``exc`` as the handler should see it: its own error, or :class:`LeaseLost` when the
        lease could not be proven any more (the server ended the transaction, the attempt
        was cancelled, the connection broke)."""
        ended = isinstance(exc, psycopg.errors.IdleInTransactionSessionTimeout)
        if not (ended or self.cancelled or self.conn.broken or self.conn.closed or fenced.refused_by_fence(exc)):
            return exc  # the handler's own statement failed: its error, not the fence's
        self.cancel("fence_ended" if ended else "lease_lost")  # the first reason wins
        return self._lease_lost(f": {first_line(exc)}")

    @property
    def in_fenced_transaction(self) -> bool:
        return self._fenced_depth > 0

    def keep_fence_alive(self) -> bool:
        """Reset the server's idle timer of the open fenced transaction (the heartbeat thread
        calls it after renewing the lease); True when sent.  psycopg serializes it with the
        handler's own statements; it runs between them, never inside one."""
        if self._fenced_depth <= 0 or self.cancelled or self._conn is None:
            return False
        deferred = getattr(self._conn, "deferred", None)
        if deferred is not None and deferred.state != deferred.SENT:
            return False  # nothing sent yet, or refused: no transaction to keep alive
        try:
            self._conn.execute(q("fence_keepalive"))
        except (psycopg.Error, LeaseLost):  # LeaseLost: the fence refused meanwhile
            return False  # the handler's transaction failed or ended: its own statement will say
        return True

    def put_result(self, key: str, value: Any) -> None:
        """Write one result by key (an idempotent upsert): inside the open fenced transaction,
        or in a fenced transaction of its own (:meth:`fenced_execute`, one round trip)."""
        if self._fenced_depth > 0:
            queue.put_result(self.conn, self.lease, key, value, now=self._db_now())
            return
        query, params = queue.put_result_statement(self.lease, key, value, now=self._db_now())
        self.fenced_execute(query, params)

    def results(self) -> dict[str, Any]:
        """The results written so far by any attempt of this job (to skip finished steps)."""
        return queue.results(self.conn, self.job.id)


def _rollback_deferred(conn: ConnectionT) -> None:
    """:func:`_rollback` of a deferred fenced transaction: psycopg's ``rollback()`` may have
    sent DEALLOCATE ALL, which takes the prepared raising fence along (prepared again on
    its next use, not counted as a loss)."""
    if conn.pgconn.transaction_status != pq.TransactionStatus.IDLE:
        _rollback(conn)
        fenced.forget_prepared(conn)


def _rollback(conn: ConnectionT) -> None:
    """End a failed fenced transaction (nothing to do when the connection is gone)."""
    if conn.closed or conn.broken:
        return
    try:
        conn.rollback()
    except psycopg.Error:
        pass
