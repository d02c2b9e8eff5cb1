"""The transactions of :class:`~consumer_sdk.store.PgInboxStore`: BEGIN sent with the first
statement, the COMMIT sent at once or deferred to the next transaction's first round trip
(``on_commit`` run once the server confirmed it), and the savepoints of attempts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import psycopg.abc
import psycopg.errors
from psycopg.pq import TransactionStatus

from consumer_sdk import _pg
from consumer_sdk.errors import DatabaseUnavailable, TransactionConflict
from consumer_sdk.store_connection import StoreConnection, _first_line
from outbox_core.queries import query


class StoreTransactions(StoreConnection):
    """Transactions, deferred COMMITs and savepoints."""

    @contextmanager
    def transaction(self, *, on_commit: Callable[[], None] | None = None,
                    defer_commit: bool = False) -> Iterator[psycopg.Connection[Any]]:
        """One transaction; yields the connection for the handler; commits on a clean exit,
        then calls ``on_commit``.

        BEGIN is sent with the transaction's first statement (one round trip for both).  With
        ``defer_commit`` a clean exit sends nothing: the COMMIT goes with the next
        transaction's first round trip (or :meth:`sync`), and ``on_commit`` runs once the
        server confirmed it; if that round trip fails, whether it committed is not known and
        ``on_commit`` never runs (the caller treats the records as unsettled: a redelivery
        finds their inbox rows when they committed).  A transaction that sent no statement
        commits nothing: its ``on_commit`` runs after the deferred one before it.

        An exception that leaves the connection broken is :class:`DatabaseUnavailable`
        (the rollback could not happen; nothing committed), and so is a connection lost
        while a COMMIT was deferred (never a silent reconnection: the records after it
        would be settled past it)."""
        if self._pending is not None:
            self._deferred_connection()
        conn = self.conn
        self._tx = conn
        self._failed = _pg.failed_trip(conn)
        self._failed.error = None  # an error of the connection's before this transaction: not its
        self._savepoint = False
        self._begun = False
        try:
            yield conn
            if not self._begun:  # nothing sent, nothing to commit (but the deferred COMMIT before)
                if defer_commit and self._pending is not None:
                    if on_commit is not None:
                        self._pending.append(on_commit)
                    return
                self._tx = None
                self.sync()
                if on_commit is not None:
                    on_commit()
                return
            if defer_commit:
                self._pending = [on_commit] if on_commit is not None else []
                return
            with self.translated():
                status = conn.execute(query("inbox", "commit")).statusmessage
            _check_committed(status)
            if on_commit is not None:
                on_commit()
        except BaseException as exc:
            if self._begun and not (conn.closed or conn.broken) \
                    and conn.info.transaction_status != TransactionStatus.IDLE:
                try:
                    conn.rollback()
                except psycopg.Error:
                    pass
            if isinstance(exc, DatabaseUnavailable) or not isinstance(exc, Exception):
                raise
            if conn.closed or conn.broken:
                self.reset()
                raise DatabaseUnavailable(f"connection lost: {_first_line(exc)}") from exc
            raise
        finally:
            self._tx = None
            if self._failed is not None:
                self._failed.error = None  # the transaction's; its traceback holds the handler's frames
                self._failed = None

    @property
    def commit_pending(self) -> bool:
        """A transaction's COMMIT was deferred and not sent yet."""
        return self._pending is not None

    def sync(self) -> None:
        """Send the deferred COMMIT (if any) and run its ``on_commit`` callbacks.  On failure
        they never run (the outcome is unknown; the records stay unsettled)."""
        if self._pending is None:
            return
        if self._tx is not None:
            raise RuntimeError("sync() runs between transactions")
        conn = self._deferred_connection()
        pending, self._pending = self._pending, None
        with self.translated():
            status = conn.execute(query("inbox", "commit")).statusmessage
        _check_committed(status)
        for callback in pending:
            callback()

    def _deferred_connection(self) -> psycopg.Connection[Any]:
        """The connection a deferred COMMIT waits on.  Gone, it is :class:`DatabaseUnavailable`
        (after a reset that drops the COMMIT's callbacks), never ``self.conn``: a new
        connection would answer COMMIT (with a warning) for a transaction lost with the old."""
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            self.reset()
            raise DatabaseUnavailable("connection lost with a COMMIT deferred: whether it committed is unknown")
        return conn

    def after_commit(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` now, or after the deferred COMMIT's callbacks when one waits."""
        if self._pending is not None:
            self._pending.append(callback)
        else:
            callback()

    def discard(self) -> None:
        """Roll the deferred COMMIT's transaction back (after an error); its callbacks never run."""
        if self._pending is None:
            return
        self._pending = None
        conn = self._conn
        if conn is not None and not (conn.closed or conn.broken):
            try:
                conn.rollback()
            except psycopg.Error:
                self.reset()

    def _prefix(self) -> str:
        """What the transaction's first round trip starts with: the deferred COMMIT, BEGIN."""
        return "COMMIT; BEGIN; " if self._pending is not None else "BEGIN; "

    def _confirmed(self, commit_status: str | None) -> None:
        """The transaction's first round trip went through (it has begun): so did the deferred
        COMMIT before it, whose callbacks run now, unless the server answered ROLLBACK."""
        self._begun = True
        pending, self._pending = self._pending, None
        if pending is None:
            return
        _check_committed(commit_status)
        for callback in pending:
            callback()

    def _first_failed(self) -> None:
        """The first round trip failed: what it carried may or may not have committed."""
        self._begun = True  # roll back whatever it left open
        self._pending = None

    def _flush(self) -> None:
        """Send BEGIN (after a deferred COMMIT) unless the transaction has begun: before any
        statement that does not carry it, and before any handler runs."""
        if self._begun:
            return
        conn = self._active
        try:
            with self.translated():
                cursor = conn.execute(self._prefix().rstrip("; "))
        except BaseException:
            self._first_failed()
            raise
        self._confirmed(cursor.statusmessage)

    @property
    def _active(self) -> psycopg.Connection[Any]:
        # Never reconnect inside a transaction: a new connection would commit on its own.
        if self._tx is None:
            raise RuntimeError("inbox operations run inside PgInboxStore.transaction()")
        return self._tx

    @contextmanager
    def attempt(self) -> Iterator[None]:
        """A savepoint: an exception rolls back to it and propagates (as DatabaseUnavailable
        when the connection broke, since then no savepoint survives).

        One round trip when nothing fails: the previous attempt's savepoint is released in
        the statement that sets this one (``savepoint_next``), and the last one by the commit.
        """
        conn = self._active
        self._flush()
        with self.translated():
            conn.execute(query("inbox", "savepoint_next" if self._savepoint else "savepoint"))
        self._savepoint = True
        try:
            yield
        except Exception as exc:
            if conn.closed or conn.broken:
                raise DatabaseUnavailable(f"connection lost: {_first_line(exc)}") from exc
            with self.translated():
                conn.execute(query("inbox", "savepoint_rollback"))
            self._savepoint = False
            raise

    def in_failed_transaction(self) -> bool:
        return self._begun and _pg.aborted(self._active)


def _check_committed(status: str | None) -> None:
    """A COMMIT of a transaction in error answers ROLLBACK instead of failing: never take
    that for a commit (the processor checks the transaction state first; this is the net)."""
    if status != "COMMIT":
        raise TransactionConflict(f"the transaction did not commit (the server answered {status})")
