"""The inbox in PostgreSQL: the :class:`~consumer_sdk.processor.InboxStore` adapter.

Only this module and :mod:`consumer_sdk.outbox` talk to psycopg.  The store owns
one connection in autocommit mode and opens each transaction in
:meth:`PgInboxStore.transaction` (BEGIN sent with its first statement), so
nothing commits outside one.  Driver errors are
translated here: an unreachable database or a broken connection is
:class:`DatabaseUnavailable`, an aborted transaction (serialization failure,
deadlock) :class:`TransactionConflict`, both retried by the consumer; a missing
table is :class:`SchemaMissing`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import datetime
from typing import Any, cast

import psycopg
import psycopg.errors
from psycopg.pq import TransactionStatus

from consumer_sdk import _pg
from consumer_sdk.errors import (
    DatabaseUnavailable,
    FatalError,
    InboxGroupConflict,
    SchemaMissing,
    TransactionConflict,
)
from consumer_sdk.model import Claim, InboxMessage
from outbox_core.queries import query

ConnectionFactory = Callable[[], psycopg.Connection[Any]]


def connect_factory(dsn: str, *, application_name: str = "outbox-consumer",
                    connect_timeout_s: int = 5) -> ConnectionFactory:
    """A factory of autocommit connections to ``dsn``."""

    def connect() -> psycopg.Connection[Any]:
        return _pg.connect(dsn, application_name=application_name, connect_timeout_s=connect_timeout_s)

    return connect


def pipelined(conn: psycopg.Connection[Any]) -> AbstractContextManager[Any]:
    """``conn.pipeline()`` (statements sent together, one round trip at its end), or, with a
    libpq older than 14 (no pipeline mode), a block that sends each statement at once: the
    same statements and answers, one round trip each."""
    return conn.pipeline() if psycopg.capabilities.has_pipeline() else nullcontext()


class PgInboxStore:
    """The inbox on one owned connection.  Not thread-safe: one consumer loop uses it."""

    def __init__(self, connect: ConnectionFactory, *,
                 now: Callable[[], datetime | None] = lambda: None) -> None:
        self._connect = connect
        self._now = now
        self._conn: psycopg.Connection[Any] | None = None
        self._tx: psycopg.Connection[Any] | None = None  # the connection of the open transaction
        self._savepoint = False  # an attempt's savepoint is set (released by the next one or the commit)
        self._pipeline: AbstractContextManager[Any] | None = None  # BEGIN not sent yet (see transaction())

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
            self._conn = conn
        return self._conn

    def reset(self) -> None:
        """Drop the connection (after a failure); the next use reconnects."""
        conn, self._conn = self._conn, None
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
    def transaction(self) -> Iterator[psycopg.Connection[Any]]:
        """One transaction; yields the connection for the handler; commits on a clean exit.

        An exception that leaves the connection broken is :class:`DatabaseUnavailable`
        (the rollback could not happen; nothing committed)."""
        conn = self.conn
        self._tx = conn
        self._savepoint = False
        try:
            with self.translated():
                # BEGIN waits in a pipeline for the transaction's first statement (a claim): one
                # round trip for both, or for BEGIN and COMMIT when nothing else came.  _flush()
                # leaves pipeline mode before any other statement and before the handler runs:
                # handlers never see pipeline mode.  (Not conn.transaction(): in pipeline mode it
                # nests pipelines of its own, which would stay on for the handler.)
                pipeline = self._pipeline = pipelined(conn)
                pipeline.__enter__()
                conn.execute(query("inbox", "begin"))
            yield conn
            with self.translated():
                conn.execute(query("inbox", "commit"))
                self._flush()
        except BaseException as exc:
            self._flush(quiet=True)
            if not (conn.closed or conn.broken) and conn.info.transaction_status != TransactionStatus.IDLE:
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

    def _flush(self, *, quiet: bool = False) -> None:
        """Send what waits in the pipeline (BEGIN, a claim) in one round trip; leave pipeline mode."""
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is None:
            return
        if quiet:  # the transaction failed already: its own error is the one to report
            try:
                pipeline.__exit__(None, None, None)
            except psycopg.Error:
                pass
            return
        with self.translated():
            pipeline.__exit__(None, None, None)

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
        """Insert the inbox row; a conflicting row is a duplicate when its hash matches."""
        key = {"consumer": consumer, "event_id": message.event_id}
        params = {**key, "payload_sha256": payload_sha256, "topic": message.topic,
                  "partition": message.partition, "offset": message.offset, "now": self._now()}
        conn = self._active
        with self.translated():
            cursor = conn.execute(query("inbox", "claim"), params)
            self._flush()  # BEGIN and this claim, one round trip, when it is the first statement
            if cursor.fetchone() is not None:
                return "new"
            found = conn.execute(query("inbox", "lookup"), key).fetchone()
        if found is None:  # deleted by retention between the two statements: it was applied
            return "duplicate"
        return "duplicate" if found[0] == payload_sha256 else "mismatch"

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
            cursor = conn.execute(query("inbox", "claim_batch"), params)
            self._flush()  # BEGIN and this claim, one round trip
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

    def applied_before(self, *, consumer: str, event_ids: Sequence[Any]) -> dict[Any, bytes | None]:
        """The committed inbox rows of these events (event id -> body hash), in one statement
        outside any transaction (the processor's duplicate check before a batch)."""
        if not event_ids:
            return {}
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
        self._flush()
        return self._active.info.transaction_status == TransactionStatus.INERROR

    # -- retention --------------------------------------------------------------------

    def cleanup_batch(self, *, consumer: str, retention_s: float, limit: int) -> int:
        """Delete up to ``limit`` of ``consumer``'s rows older than ``retention_s``; returns the count."""
        params = {"consumer": consumer, "retention_s": retention_s, "limit": limit, "now": self._now()}
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
