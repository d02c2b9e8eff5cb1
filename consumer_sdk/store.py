"""The inbox in PostgreSQL: the :class:`~consumer_sdk.processor.InboxStore` adapter.

Only this module and :mod:`consumer_sdk.outbox` talk to psycopg.  The store owns
one connection in autocommit mode and opens each transaction in
:meth:`PgInboxStore.transaction` (BEGIN sent with its first statement), so
nothing commits outside one.  A transaction may end with its COMMIT deferred
(``defer_commit``): the COMMIT then goes in one round trip with the next
transaction's BEGIN and first statement, or with :meth:`PgInboxStore.sync`, and the
transaction's ``on_commit`` runs only once the server confirmed that COMMIT.  Driver errors are
translated here: an unreachable database or a broken connection is
:class:`DatabaseUnavailable`, an aborted transaction (serialization failure,
deadlock) :class:`TransactionConflict`, both retried by the consumer; a missing
table is :class:`SchemaMissing`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import datetime
from typing import Any, cast

import psycopg
import psycopg.abc
import psycopg.errors
from psycopg.pq import TransactionStatus

from consumer_sdk import _pg, _wire
from consumer_sdk._pg import connect_factory as connect_factory  # the inbox's, re-exported
from consumer_sdk.errors import (
    DatabaseUnavailable,
    FatalError,
    InboxGroupConflict,
    SchemaMissing,
    TransactionConflict,
)
from consumer_sdk.model import Claim, InboxMessage
from outbox_core.pooling import transaction_pooled
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


def pipelined(conn: psycopg.Connection[Any]) -> AbstractContextManager[Any]:
    """``conn.pipeline()`` (statements sent together, one round trip at its end), or, with a
    libpq older than 14 (no pipeline mode), a block that sends each statement at once: the
    same statements and answers, one round trip each."""
    return conn.pipeline() if psycopg.capabilities.has_pipeline() else nullcontext()


def _waits_of(spinner: Spinner | None) -> tuple[int, int, int] | None:
    return None if spinner is None else (spinner.hits, spinner.misses, spinner.skipped)


class PgInboxStore:
    """The inbox on one owned connection.  Not thread-safe: one consumer loop uses it."""

    #: The handler's writes go through this transaction's connection and roll back with it:
    #: the processor needs no savepoint per message while nothing fails.
    handler_writes_roll_back = True

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

    def probe_pooler(self) -> bool:
        """True when this store's database is reached through a transaction pooler
        (:func:`outbox_core.pooling.transaction_pooled`, two short connections); psycopg's
        automatic preparing is then off for the store's connections from now on: its
        statement names are per client connection, and such a pooler shares server sessions
        between clients, so a name could be missing there, or hold another client's
        statement.  The inbox's own prepared statements are named per statement and stay."""
        with self.translated():
            pooled = transaction_pooled(self._connect)
        if pooled:
            self._auto_prepare = False
            if self._conn is not None:
                self._conn.prepare_threshold = None
        return pooled

    def reset(self) -> None:
        """Drop the connection (after a failure); the next use reconnects.  A deferred COMMIT
        is lost with it (its transaction rolls back): its ``on_commit`` never runs."""
        self._retired_waits = self.waits  # the dropped connection's waits stay counted
        conn, self._conn = self._conn, None
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
        except psycopg.errors.TransactionRollback as exc:
            raise TransactionConflict(f"transaction aborted: {_first_line(exc)}") from exc
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            self.reset()
            raise DatabaseUnavailable(f"database unavailable: {_first_line(exc)}") from exc
        except psycopg.Error as exc:
            if self.lost_prepared(exc):  # the store's own statement, run often enough to be prepared
                self.reset()  # its transaction with it: the batch is retried whole
                raise DatabaseUnavailable(f"a transaction pooler lost a statement psycopg had prepared "
                                          f"({_first_line(exc)}); psycopg's automatic preparing is off "
                                          f"from now on") from exc
            raise FatalError(f"inbox statement failed: {_first_line(exc)}") from exc

    def check_schema(self) -> None:
        """Raise :class:`SchemaMissing` unless the inbox table exists."""
        with self.translated():
            row = self.conn.execute(query("inbox", "schema_check")).fetchone()
        if not row or not row[0]:
            raise SchemaMissing("the inbox table is missing: run `outbox-relay migrate` (0004_inbox)")

    def bind_group(self, *, consumer: str, group: str) -> None:
        """Record ``group`` as the inbox name's group at first use; raise
        :class:`InboxGroupConflict` when the name belongs to another group."""
        params = {"consumer": consumer, "group": group}
        with self.translated():
            self.conn.execute(query("inbox", "bind_group"), params)
            row = self.conn.execute(query("inbox", "bound_group"), params).fetchone()
        if row is not None and row[0] != group:
            raise InboxGroupConflict(
                f"inbox name {consumer!r} belongs to consumer group {row[0]!r}, not {group!r}: two groups on "
                "one inbox name would drop each other's events as duplicates; use another name (a new "
                "inbox) or the same group_id")

    # -- InboxStore -------------------------------------------------------------------

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

    def claim(self, *, consumer: str, message: InboxMessage, payload_sha256: bytes | None) -> Claim:
        """Insert the inbox row; a conflicting row is a duplicate when its hash matches.

        As the transaction's first statement it goes in one simple query with BEGIN (and the
        deferred COMMIT before it), its parameters bound on the client: one round trip, and
        less client CPU than pipeline mode for one scalar statement."""
        key = {"consumer": consumer, "event_id": message.event_id}
        params = {**key, "payload_sha256": payload_sha256, "topic": message.topic,
                  "partition": message.partition, "offset": message.offset, "now": self._now()}
        conn = self._active
        with self.translated():
            if self._begun:
                row = conn.execute(query("inbox", "claim"), params).fetchone()
            else:
                row = self._first_claim(conn, params)
            if row is not None:
                return "new"
            found = conn.execute(query("inbox", "lookup"), key).fetchone()
        if found is None:  # deleted by retention between the two statements: it was applied
            return "duplicate"
        return "duplicate" if found[0] == payload_sha256 else "mismatch"

    def _first_claim(self, conn: psycopg.Connection[Any], params: dict[str, Any]) -> Any:
        """[COMMIT;] BEGIN; claim, in one round trip; returns the claim's row (None: a conflict).

        The prepared claim in one libpq pipeline where it can (see :mod:`consumer_sdk._wire`),
        else one simple query with the parameters bound on the client."""
        if self._claim_prepared(conn):
            return self._first_claim_prepared(conn, params)
        if self._client is None or self._client.connection is not conn:
            self._client = psycopg.ClientCursor(conn)
        cursor = self._client
        try:
            cursor.execute(self._prefix() + query("inbox", "claim"), params)
        except BaseException:
            self._first_failed()
            raise
        self._confirmed(cursor.statusmessage)  # the first result: COMMIT's (or BEGIN's)
        while cursor.nextset():
            pass
        return cursor.fetchone()

    def _claim_prepared(self, conn: psycopg.Connection[Any]) -> bool:
        """True when ``conn`` holds the prepared claim, preparing it when it can (never with a
        COMMIT deferred: its transaction is still open)."""
        if self._prepared_on is conn:
            return True
        if self._pending is not None or self._prepared_losses >= _PREPARED_LOSSES_MAX \
                or not _wire.available(conn):
            return False
        _wire.prepare(conn, query("inbox", "claim_prepare").encode())
        self._prepared_on = conn
        return True

    def _first_claim_prepared(self, conn: psycopg.Connection[Any], params: dict[str, Any]) -> Any:
        values = _claim_values(params)
        leading = (_wire.COMMIT, _wire.BEGIN) if self._pending is not None else (_wire.BEGIN,)
        try:
            results = _wire.send_before(conn, leading, CLAIM_STATEMENT, values)
            _wire.raise_first_error(conn, results[:len(leading)])
        except BaseException:
            self._first_failed()
            raise
        status = results[0].command_status
        self._confirmed(status.decode() if status is not None else None)
        claim = results[len(leading)]
        if _wire.failed(claim):
            try:
                _wire.raise_first_error(conn, [claim])
            except psycopg.errors.InvalidSqlStatementName:  # DISCARD ALL, or another server session
                conn.rollback()  # the transaction BEGIN opened, aborted by the claim
                self._begun = False
                self._prepared_on = None
                self._prepared_losses += 1
                return self._first_claim(conn, params)
        self._prepared_losses = 0
        return (True,) if claim.ntuples else None

    def claim_and_apply(self, *, consumer: str, message: InboxMessage, payload_sha256: bytes | None,
                        statements: Sequence[tuple[Any, Any]]) -> bool | None:
        """A whole transaction in one round trip: BEGIN, the inbox row (``claim_strict``: a
        conflict fails it), ``statements`` (``(query, params)`` pairs, bound as a cursor binds
        them) and COMMIT, in one libpq pipeline with one Sync.  Runs between transactions,
        with no COMMIT deferred.

        True: committed.  False: nothing was written (the event was there already, a
        statement or the COMMIT failed, a statement could not be bound) and no transaction
        is left open; the caller takes the usual way, which says why.  None: this
        connection cannot take the path (no libpq pipeline mode, or psycopg's internals
        missing: :func:`consumer_sdk._wire.available`).  A broken connection is
        :class:`DatabaseUnavailable`: whether the COMMIT happened is unknown (a redelivery
        finds the inbox row if it did)."""
        if self._tx is not None or self._pending is not None:
            raise RuntimeError("claim_and_apply() runs between transactions, with no COMMIT deferred")
        with self.translated():
            conn = self.conn
        if not _wire.available(conn):
            return None
        with self.translated():
            strict = self._strict_prepared(conn)
        parts = self._trip(conn, consumer=consumer, message=message, payload_sha256=payload_sha256,
                           statements=statements, strict=strict)
        if parts is None:
            return False
        claim, steps = parts
        with self.translated():
            results = _wire.send_all(conn, [_wire.Step(_wire.BEGIN), claim, *steps, _wire.Step(_wire.COMMIT)])
            if _committed(results):
                if claim.prepared:
                    self._prepared_losses = 0
                return True
            self._note_strict_lost(results[1], conn)
            _wire.roll_back(conn)  # below psycopg: its rollback() would take the prepared claims along
        return False

    def _trip(self, conn: psycopg.Connection[Any], *, consumer: str, message: InboxMessage,
              payload_sha256: bytes | None, statements: Sequence[tuple[Any, Any]],
              strict: bool) -> tuple[_wire.Step, list[_wire.Step]] | None:
        """A one-trip transaction's inbox row (``claim_strict``, prepared by name when
        ``strict``) and its statements, bound as a cursor binds them; None when a statement
        cannot be bound (the handler's mistake: a wrong parameter count, a value with no
        dumper), raised again where the usual way runs the statements."""
        params = {"consumer": consumer, "event_id": message.event_id, "payload_sha256": payload_sha256,
                  "topic": message.topic, "partition": message.partition, "offset": message.offset,
                  "now": self._now()}
        try:
            binder = self._binder(conn)
            steps = [_wire.bind(conn, sql, args, transformer=binder) for sql, args in statements]
        except Exception:  # noqa: BLE001 - raised again where the usual way runs the statements
            return None
        if strict:
            return _wire.Step(CLAIM_STRICT_STATEMENT, _claim_values(params), prepared=True), steps
        return _wire.bind(conn, query("inbox", "claim_strict"), params, transformer=binder), steps

    def _note_strict_lost(self, claim: psycopg.pq.abc.PGresult, conn: psycopg.Connection[Any]) -> None:
        """The prepared ``claim_strict`` was not on the server (invalid_sql_statement_name:
        DISCARD ALL, or another server session): prepared again next time, a loss counted."""
        if self._strict_on is conn and claim.status == psycopg.pq.ExecStatus.FATAL_ERROR \
                and claim.error_field(psycopg.pq.DiagnosticField.SQLSTATE) == b"26000":
            self._strict_on = None
            self._prepared_losses += 1

    def send_trip(self, *, consumer: str, message: InboxMessage, payload_sha256: bytes | None,
                  statements: Sequence[tuple[Any, Any]]) -> bool | None:
        """:meth:`claim_and_apply`'s transaction, chained: sent without waiting for the answers
        to the transactions sent before it (:meth:`receive_trip` reads them, in order;
        :meth:`end_trips` ends the chain).  It begins with the ``chain`` statement, so that
        it commits only when the transaction sent before it committed (see inbox.sql).

        True: sent.  False: not sent (a statement could not be bound); the chain goes on.
        None: this store cannot chain (no pipeline mode, or a chain broke behind a pooler
        that does not keep a session's settings): the caller uses :meth:`claim_and_apply`."""
        trips = self._trips
        if trips is None:
            if self._tx is not None or self._pending is not None:
                raise RuntimeError("send_trip() runs between transactions, with no COMMIT deferred")
            if not self._chain_on:
                return None
            with self.translated():
                conn = self.conn
                if not _wire.available(conn):
                    return None
                strict = self._strict_prepared(conn)  # a PREPARE: before the pipeline opens
            trips = _wire.Trips(conn)
            self._chain_last = None
            self._chain_prev_ok = False
        else:
            conn = trips.conn
            strict = self._strict_on is conn
        parts = self._trip(conn, consumer=consumer, message=message, payload_sha256=payload_sha256,
                           statements=statements, strict=strict)
        if parts is None:
            return False
        claim, steps = parts
        self._chain_seq += 1
        mark = f"{self._chain_id}:{self._chain_seq}"
        after = self._chain_last
        chain = _wire.Step(_CHAIN, [None if after is None else after.encode(), mark.encode()])
        self._trips = trips
        with self.translated():
            trips.send([_wire.Step(_wire.BEGIN), chain, claim, *steps, _wire.Step(_wire.COMMIT)])
        self._chain_last = mark
        return True

    def receive_trip(self) -> bool:
        """Whether the oldest chained transaction not read yet committed.  False: nothing of
        it was written; every one sent after it fails too (read them, then :meth:`end_trips`)
        and goes the usual way, in order.  A broken connection is
        :class:`DatabaseUnavailable`: what committed is unknown (a redelivery finds it)."""
        trips = self._trips
        if trips is None or not len(trips):
            raise RuntimeError("receive_trip() without a chained transaction sent")
        with self.translated():
            results = trips.receive()
        prev_ok, self._chain_prev_ok = self._chain_prev_ok, False
        if _committed(results):
            self._chain_prev_ok = True
            if self._strict_on is trips.conn:  # through the prepared claim: a run of losses ends
                self._prepared_losses = 0
            return True
        if results[1].status == psycopg.pq.ExecStatus.FATAL_ERROR and prev_ok:
            # The one before committed, yet this one did not find its mark: the session's
            # setting did not carry over (a transaction pooler): one transaction at a time.
            self._chain_on = False
        else:
            self._note_strict_lost(results[2], trips.conn)
        return False

    def end_trips(self) -> None:
        """End a chain: read the answers not read yet, and roll back a failed transaction
        left open (below psycopg, as :meth:`claim_and_apply` does).  Idempotent."""
        trips, self._trips = self._trips, None
        if trips is None:
            return
        with self.translated():
            trips.close()
            _wire.roll_back(trips.conn)

    def can_pipeline(self) -> bool:
        """The open transaction's connection can take :meth:`execute_all`."""
        return _wire.available(self._active)

    def execute_all(self, statements: Sequence[tuple[Any, Any]]) -> None:
        """``statements`` (``(query, params)`` pairs, bound as a cursor binds them) in the open
        transaction, in one libpq pipeline with one Sync: one round trip.  The first failure
        is raised as psycopg raises it (the server skipped the rest; roll back to a
        savepoint, see :meth:`attempt`); a broken connection is :class:`DatabaseUnavailable`.
        Check :meth:`can_pipeline` first."""
        conn = self._active
        binder = self._binder(conn)
        steps = [_wire.bind(conn, sql, args, transformer=binder) for sql, args in statements]
        self._flush()
        with self.translated():  # driver errors only: a statement's error is a result here
            results = _wire.send_all(conn, steps)
        _wire.raise_first_error(conn, results)

    def _binder(self, conn: psycopg.Connection[Any]) -> psycopg.abc.Transformer:
        """The transformer that binds statements for ``conn``, kept while it is the store's
        connection (dropped by :meth:`reset`): it keeps the dumpers it found."""
        binder = self._transformer
        if binder is None or binder.connection is not conn:
            binder = self._transformer = _wire.transformer(conn)
        return binder

    def _strict_prepared(self, conn: psycopg.Connection[Any]) -> bool:
        """True when ``conn`` holds the prepared ``claim_strict``, preparing it when it can (as
        :meth:`_claim_prepared` does for the claim, under the same count of losses)."""
        if self._strict_on is conn:
            return True
        if self._prepared_losses >= _PREPARED_LOSSES_MAX:
            return False
        _wire.prepare(conn, query("inbox", "claim_strict_prepare").encode())
        self._strict_on = conn
        return True

    def claim_many(self, *, consumer: str, messages: Sequence[InboxMessage],
                   digests: Sequence[bytes | None]) -> list[Claim]:
        """:meth:`claim` for a batch of distinct events, in one statement (two when a
        concurrent transaction committed one of them meanwhile)."""
        if not messages:
            return []
        if len(messages) == 1:  # scalar parameters: cheaper to encode than five 1-element arrays
            return [self.claim(consumer=consumer, message=messages[0], payload_sha256=digests[0])]
        params = {"consumer": consumer, "event_ids": [m.event_id for m in messages], "hashes": list(digests),
                  "topics": [m.topic for m in messages], "partitions": [m.partition for m in messages],
                  "offsets": [m.offset for m in messages], "now": self._now()}
        conn = self._active
        with self.translated():
            if self._begun:
                cursor = conn.execute(query("inbox", "claim_batch"), params)
            else:
                cursor = self._first_in_pipeline(conn, query("inbox", "claim_batch"), params)
            claims: list[str] = [row[0] for row in cursor.fetchall()]
            unseen = [i for i, claim in enumerate(claims) if claim == "unseen"]
            if unseen:
                ids = [messages[i].event_id for i in unseen]
                found = dict(conn.execute(query("inbox", "lookup_batch"),
                                          {"consumer": consumer, "event_ids": ids}).fetchall())
                for i in unseen:  # absent: deleted by retention after it was applied
                    event_id = messages[i].event_id
                    claims[i] = "duplicate" if event_id not in found or found[event_id] == digests[i] \
                        else "mismatch"
        return cast("list[Claim]", claims)

    def _first_in_pipeline(self, conn: psycopg.Connection[Any], sql: str, params: dict[str, Any]) -> Any:
        """[COMMIT,] BEGIN and a statement with array parameters (sent in binary, which client
        binding cannot do) in one pipeline: one round trip (libpq < 14: one each)."""
        try:
            with pipelined(conn):
                commit = conn.execute(query("inbox", "commit")) if self._pending is not None else None
                conn.execute(query("inbox", "begin"))
                cursor = conn.execute(sql, params)
        except BaseException:
            self._first_failed()
            raise
        self._confirmed(commit.statusmessage if commit is not None else None)
        return cursor

    def applied_before(self, *, consumer: str, event_ids: Sequence[Any]) -> dict[Any, bytes | None]:
        """The committed inbox rows of these events (event id -> body hash), in one statement
        outside any transaction (the processor's duplicate check before a batch)."""
        if not event_ids:
            return {}
        if self._pending is not None:
            raise RuntimeError("applied_before() runs with no deferred COMMIT (sync() first)")
        conn = self.conn
        with self.translated():
            rows = conn.execute(query("inbox", "lookup_batch"),
                                {"consumer": consumer, "event_ids": list(event_ids)}).fetchall()
        return dict(rows)

    def unclaim(self, *, consumer: str, event_ids: Sequence[Any]) -> None:
        """Delete the rows this transaction claimed for records it will not apply after all."""
        if event_ids:
            self._flush()
            with self.translated():
                self._active.execute(query("inbox", "unclaim"),
                                     {"consumer": consumer, "event_ids": list(event_ids)})

    def in_failed_transaction(self) -> bool:
        # pgconn's status: conn.info builds an object and an enum at every call (once a message)
        return self._begun and self._active.pgconn.transaction_status == TransactionStatus.INERROR

    # -- retention --------------------------------------------------------------------

    def cleanup_batch(self, *, consumer: str, retention_s: float, limit: int) -> int:
        """Delete up to ``limit`` of ``consumer``'s rows older than ``retention_s``; returns the count."""
        params = {"consumer": consumer, "retention_s": retention_s, "limit": limit, "now": self._now()}
        self.sync()  # never inside a deferred COMMIT's transaction
        conn = self.conn
        with self.translated(), conn.transaction():
            return conn.execute(query("inbox", "cleanup_batch"), params).rowcount


def cleanup_inbox(store: PgInboxStore, *, consumer: str, retention_s: float, batch: int = 1000,
                  max_batches: int = 100) -> int:
    """Retention in bounded batches (each its own short transaction); returns rows deleted.

    ``retention_s`` must exceed the redelivery horizon of the consumer's topics
    (their retention): a message redelivered after its inbox row is gone would be
    applied again.  :class:`~consumer_sdk.inbox.InboxConsumer` checks that at start.
    """
    total = 0
    for _ in range(max_batches):
        deleted = store.cleanup_batch(consumer=consumer, retention_s=retention_s, limit=batch)
        total += deleted
        if deleted < batch:
            break
    return total


def _claim_values(params: dict[str, Any]) -> list[bytes | None]:
    """A claim's parameters as the prepared claims take them: text, in their order."""
    digest, now = params["payload_sha256"], params["now"]
    return [params["consumer"].encode(), str(params["event_id"]).encode(),
            None if digest is None else b"\\x" + digest.hex().encode(), params["topic"].encode(),
            b"%d" % params["partition"], b"%d" % params["offset"],
            None if now is None else now.isoformat().encode()]


def _committed(results: Sequence[psycopg.pq.abc.PGresult]) -> bool:
    """A one-trip transaction's results (its COMMIT's second to last, before the Sync's): True
    when every statement went through and the COMMIT committed."""
    if any(_wire.failed(result) for result in results):
        return False
    status = results[-2].command_status
    _check_committed(status.decode() if status is not None else None)
    return True


def _check_committed(status: str | None) -> None:
    """A COMMIT of a transaction in error answers ROLLBACK instead of failing: never take
    that for a commit (the processor checks the transaction state first; this is the net)."""
    if status != "COMMIT":
        raise TransactionConflict(f"the transaction did not commit (the server answered {status})")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
