"""The connection part of :class:`~consumer_sdk.store.PgInboxStore`: the one connection the
store owns, (re)connected on demand and dropped after a failure, and the translation of
driver errors into the SDK's.

The store is built from parts, a module each: this one, the transactions with their
deferred COMMIT and savepoints (:mod:`consumer_sdk.store_transactions`), the claims of
inbox rows (:mod:`consumer_sdk.store_claims`), the one-trip and chained transactions of a
statements handler (:mod:`consumer_sdk.store_trips`), and the rest in
:mod:`consumer_sdk.store`, where it is imported from.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import psycopg
import psycopg.abc
import psycopg.errors
from psycopg.pq import TransactionStatus

from consumer_sdk import _pg, _wire
from consumer_sdk.errors import (
    DatabaseUnavailable,
    FatalError,
    RetriableError,
    SchemaMissing,
    TransactionConflict,
)
from outbox_core.queries import query
from outbox_core.spin import Spinner

ConnectionFactory = Callable[[], psycopg.Connection[Any]]

#: The claim prepared on the connection, as ``claim_prepare`` in inbox.sql names it.
CLAIM_STATEMENT = b"outbox_inbox_claim_v1"
#: The strict claim of a one-trip transaction, as ``claim_strict_prepare`` names it.
CLAIM_STRICT_STATEMENT = b"outbox_inbox_claim_strict_v1"
#: After the prepared claim was gone this many times in a row (prepared again each time, and
#: gone again before a claim could use it: a pooler that moves sessions between servers),
#: the store claims through a cursor for good.  A single loss (DISCARD ALL; psycopg's
#: DEALLOCATE ALL after a rollback) costs one round trip more, then it is prepared again.
_PREPARED_LOSSES_MAX = 3
_CHAIN = query("inbox", "chain").encode()  # positional parameters: sent as it is


def _waits_of(spinner: Spinner | None) -> tuple[int, int, int] | None:
    return None if spinner is None else (spinner.hits, spinner.misses, spinner.skipped)


class StoreConnection:
    """The owned connection and the error translation (see the module docstring)."""

    def __init__(self, connect: ConnectionFactory, *,
                 now: Callable[[], datetime | None] = lambda: None) -> None:
        self._connect = connect
        self._now = now
        self._conn: psycopg.Connection[Any] | None = None
        self._tx: psycopg.Connection[Any] | None = None  # the connection of the open transaction
        self._savepoint = False  # an attempt's savepoint is set (released by the next one or the commit)
        self._begun = False  # the open transaction's BEGIN was sent (it rides with its first statement)
        # A deferred COMMIT: the transaction stays open on the connection until the next
        # transaction's first round trip (or sync()) sends it; then these run, in order.
        self._pending: list[Callable[[], None]] | None = None
        self._client: psycopg.ClientCursor[Any] | None = None  # for BEGIN (and COMMIT) with a claim
        self._prepared_on: psycopg.Connection[Any] | None = None  # holds the prepared claim
        self._strict_on: psycopg.Connection[Any] | None = None  # holds the prepared claim_strict
        self._transformer: psycopg.abc.Transformer | None = None  # binds statements for self._conn (_wire.bind)
        self._prepared_losses = 0
        # Chained transactions (send_trip): the open pipeline, this store's marks, the mark the
        # last transaction sent sets, and whether the last one read committed.
        self._trips: _wire.Trips | None = None
        self._chain_id = os.urandom(4).hex()
        self._chain_seq = 0
        self._chain_last: str | None = None
        self._chain_prev_ok = False
        self._chain_on = True  # off once a chain broke with nothing failing before it (a pooler)
        self._auto_prepare = True  # psycopg's automatic preparing; off once a pooler lost one (lost_prepared)
        self._retired_waits: tuple[int, int, int] | None = None  # the waits of polling connections dropped
        self._failed: _pg.FailedTrip | None = None  # the open transaction's (see swallowed_error)
        #: The live connection's session as (backend pid, application_name), None without one:
        #: read by the consumer's LockWaitWatch, on its own thread (one attribute, set at once).
        self.session: tuple[int, str] | None = None

    @property
    def conn(self) -> psycopg.Connection[Any]:
        """The live connection, (re)connected on demand."""
        if self._conn is None or self._conn.closed or self._conn.broken:
            self.reset()
            try:
                conn = self._connect()
            except (psycopg.OperationalError, psycopg.ProgrammingError) as exc:  # a factory of the caller's
                raise _pg.translate_connect_error(exc) from None
            if not conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
                conn.autocommit = True  # transactions come from conn.transaction() blocks only
            if not self._auto_prepare:
                conn.prepare_threshold = None
            self._conn = conn
            self.session = (conn.info.backend_pid, conn.info.parameter_status("application_name") or "")
        return self._conn

    @property
    def spinner(self) -> Spinner | None:
        """The live connection's :class:`~outbox_core.spin.Spinner` (None: it does not poll)."""
        return getattr(self._conn, "spinner", None)

    @property
    def waits(self) -> tuple[int, int, int] | None:
        """Waits for an answer on every polling connection this store made, the dropped ones
        included: (answered while polling, slept after polling, slept at once while paused);
        None when none of them polled."""
        live = _waits_of(self.spinner)
        retired = self._retired_waits
        if live is None or retired is None:
            return live or retired
        return (live[0] + retired[0], live[1] + retired[1], live[2] + retired[2])

    def swallowed_error(self) -> psycopg.Error | None:
        """The error that aborted the open transaction, for a handler that caught it and
        returned: the error of the last round trip on this connection when it failed, however
        the handler ran its statement (``execute``, ``executemany``, ``copy``, ``stream``, a
        pipeline's sync or end, a server-side cursor: see :func:`consumer_sdk._pg._watch`).  Not
        counting the errors that only follow from an earlier one: a statement refused because the
        transaction was aborted already (25P02), or one skipped because an earlier statement of
        its pipeline failed (``PipelineAborted``).  None when none failed, or the transaction was
        sound again after it (a rollback to a savepoint), or outside a transaction: then the
        handler's failure is all that is known.  The connection's
        :class:`~consumer_sdk._pg.FailedTrip` tells it, cleared where each transaction starts."""
        failed = self._failed
        return None if failed is None else failed.error

    def lost_prepared(self, exc: BaseException) -> bool:
        """True when ``exc`` says a transaction pooler lost one of psycopg's own prepared
        statements (:func:`consumer_sdk._pg.lost_prepared_statement`).  psycopg's automatic
        preparing is then off for this store's connections from now on (the inbox's own
        statements are prepared by name, and prepared again where missing)."""
        if not _pg.lost_prepared_statement(exc):
            return False
        self._auto_prepare = False
        if self._conn is not None:
            self._conn.prepare_threshold = None
        return True

    def database_failure(self, exc: BaseException) -> RetriableError | None:
        """The :class:`RetriableError` that ``exc``, raised by a handler's statements on this
        store's connection, stands for when what failed is the database or the transaction,
        not the message or the handler; None when it is the handler's own failure, for the
        retry policy.

        The database (:class:`DatabaseUnavailable`): the connection lost or closed (SQLSTATE
        class 08, a driver error without one, the connection found broken), the server ending
        the session (57P01 ``pg_terminate_backend``, 57P02, 57P03), the database read-only
        (25006: a standby, a failover), or a pooler that lost a statement psycopg prepared
        (:meth:`lost_prepared`).  The transaction (:class:`TransactionConflict`): the server
        aborted it to resolve a conflict (class 40: a serialization failure, a deadlock), and
        PostgreSQL's answer to that is to run it again; the SDK's own COMMIT meeting it was
        always retried so.  The error itself counts, or one it was raised from (``raise ...
        from``: a handler that wraps the driver's errors in its own).  Anything else (a
        constraint, the handler's SQL, its own ``statement_timeout``) is the handler's.  A
        statement refused because the transaction (25P02) or its pipeline (``PipelineAborted``)
        was aborted already is judged by the error that aborted it, when the handler caught
        that one (:meth:`swallowed_error`); else it is the handler's."""
        for error in _causes(exc):
            if isinstance(error, psycopg.Error) and _pg.consequence(error):
                # 25P02 or PipelineAborted: the handler caught the error that aborted its
                # transaction (or its pipeline), and its next statement met the abort; that
                # caught error says whose failure it was.  Unknown: the handler's.
                swallowed = self.swallowed_error()
                return None if swallowed is None else self.database_failure(swallowed)
            if isinstance(error, psycopg.errors.ReadOnlySqlTransaction):
                return _read_only(error)
            if _conflict(error):
                return TransactionConflict(f"transaction aborted: {_first_line(error)}")
            if self.lost_prepared(error):
                return _lost_prepared(error)
            if isinstance(error, psycopg.Error) and _pg.connection_failed(error):
                return DatabaseUnavailable(f"database unavailable: {_first_line(error)}")
        conn = self._tx or self._conn
        if conn is not None and (conn.closed or conn.broken):
            return DatabaseUnavailable(f"connection lost: {_first_line(exc)}")
        return None

    def reset(self) -> None:
        """Drop the connection (after a failure); the next use reconnects.  A deferred COMMIT
        is lost with it (its transaction rolls back): its ``on_commit`` never runs."""
        self._retired_waits = self.waits  # the dropped connection's waits stay counted
        conn, self._conn = self._conn, None
        self.session = None
        self._pending = None
        trips, self._trips = self._trips, None
        if trips is not None:
            trips.abandon()
        self._client = None
        self._prepared_on = None
        self._strict_on = None
        self._transformer = None
        if conn is not None:
            try:
                conn.close()
            except psycopg.Error:
                pass

    close = reset


    @contextmanager
    def translated(self) -> Iterator[None]:
        """Translate driver errors raised inside the block into SDK errors."""
        try:
            yield
        except psycopg.errors.UndefinedTable as exc:
            raise SchemaMissing() from exc
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            if _conflict(exc):  # the transaction aborted; the session is sound
                raise TransactionConflict(f"transaction aborted: {_first_line(exc)}") from exc
            self.reset()
            raise DatabaseUnavailable(f"database unavailable: {_first_line(exc)}") from exc
        except psycopg.errors.ReadOnlySqlTransaction as exc:
            # SQLSTATE 25006: a standby, or a primary being failed over.  Waited for like an
            # unreachable database, on a new connection (a session keeps its read-only
            # setting; a multi-host DSN with target_session_attrs=read-write finds the new
            # primary).  It stopped the consumer with a FatalError before.
            self.reset()
            raise _read_only(exc) from exc
        except psycopg.Error as exc:
            if self.lost_prepared(exc):  # the store's own statement, run often enough to be prepared
                self.reset()  # its transaction with it: the batch is retried whole
                raise _lost_prepared(exc) from exc
            raise FatalError(f"inbox statement failed: {_first_line(exc)}") from exc


def _conflict(exc: BaseException) -> bool:
    """``exc`` is SQLSTATE class 40: the server aborted the transaction to resolve a conflict
    (40001 a serialization failure, 40P01 a deadlock).  Read by SQLSTATE: psycopg's classes
    of them are not one hierarchy (``SerializationFailure`` is no ``TransactionRollback``),
    and until an audit the store's own statement meeting a deadlock was "database
    unavailable", its connection dropped."""
    return isinstance(exc, psycopg.Error) and (exc.sqlstate or "").startswith("40")


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then the errors it was raised from (``__cause__``), a few at most."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return
        yield seen
        seen = seen.__cause__


def _read_only(exc: BaseException) -> DatabaseUnavailable:
    return DatabaseUnavailable(f"the database is read-only (a standby, or a failover in progress): "
                               f"{_first_line(exc)}; waiting for a writable primary")


def _lost_prepared(exc: BaseException) -> DatabaseUnavailable:
    return DatabaseUnavailable(f"a transaction pooler lost a statement psycopg had prepared "
                               f"({_first_line(exc)}); psycopg's automatic preparing is off from now on")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
