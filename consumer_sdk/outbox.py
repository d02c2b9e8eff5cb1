"""Write events into the outbox on the caller's connection, inside the caller's transaction.

The guarantee: the event row commits if and only if the caller's transaction
commits, so an event is never announced for a change that rolled back, and never
missing for one that committed.  These functions never commit, roll back or open
a transaction themselves.  A connection in autocommit mode outside a
``conn.transaction()`` block is refused with :class:`TransactionRequired`, since
the row would commit on its own and the atomicity would be gone.  A
non-autocommit connection (psycopg's default) is fine: the caller commits.

Payloads: ``bytes`` (or ``bytearray``/``memoryview``) go to ``payload_bytes`` and
reach Kafka unchanged; ``None`` is a tombstone; anything else is JSON-encoded into
the ``payload`` jsonb column.  Headers are strings (or None).  ``event_id`` is a
UUID generated here (or given) and returned; the relay sends it as the
``event_id`` header.  Generated ids are time-ordered (version 7, :func:`new_event_id`),
like the table's own default: a batch's entries in the unique ``event_id`` index, which
every insert and every mark writes, land on neighbouring pages.  A W3C trace context
passed as ``traceparent``/``tracestate`` travels in the headers of the same names.

The asyncio twins live in :mod:`consumer_sdk.aio` and share :func:`prepare`.  This module
is the writing on the caller's connection; the checking and encoding, which need no
database, are :mod:`consumer_sdk.outbox_encoding`, and the trace context's rules, which
jobs keep too, :mod:`consumer_sdk.trace_context`.  Their names stay importable from here.

Bad arguments are refused before anything reaches the database, so the caller's
transaction stays usable: :class:`InvalidEvent` (a ``ValueError``) names the argument
and what is allowed, without echoing payload or header values.  A connection that is
not a sync ``psycopg.Connection`` (an ``AsyncConnection``, None) raises
:class:`WrongConnection` (an ``InvalidEvent`` and a ``TypeError``); a closed one (or one
psycopg found lost) :class:`ConnectionClosed`, before any SQL.  Text stored in
PostgreSQL can hold neither NUL characters nor lone surrogates, so topic, key, payload
strings and headers with either are refused; trace context never fails a write (an
invalid ``traceparent`` is dropped, with its ``tracestate``; a ``tracestate`` too long or
unstorable is dropped, :func:`kept_tracestate`).  Patterns are matched with
``fullmatch`` (``$`` would accept a trailing newline).
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
import psycopg.errors
from psycopg.pq import TransactionStatus

from consumer_sdk.errors import (
    DuplicateEvent,
    InvalidEvent,
    OutboxSdkError,
    SchemaMissing,
    TransactionRequired,
)
from consumer_sdk.outbox_encoding import (
    OutboxEvent,
    Prepared,
    encode_headers,
    encode_payload,
    new_event_id,
    prepare,
)
from consumer_sdk.trace_context import (
    MAX_TRACESTATE_CHARS,
    TRACEPARENT_HEADER,
    TRACESTATE_HEADER,
    kept_tracestate,
    valid_traceparent,
)
from outbox_core.queries import query

# The writing here, and what users import from here that lives in the two modules above.
__all__ = [
    "EVENT_ID_CONSTRAINT",
    "MAX_TRACESTATE_CHARS",
    "TRACEPARENT_HEADER",
    "TRACESTATE_HEADER",
    "ConnectionClosed",
    "OutboxEvent",
    "Prepared",
    "WrongConnection",
    "encode_headers",
    "encode_payload",
    "insert_errors",
    "kept_tracestate",
    "new_event_id",
    "prepare",
    "require_sync_connection",
    "require_transaction",
    "valid_traceparent",
    "write_event",
    "write_events",
]


class WrongConnection(InvalidEvent, TypeError):
    """The connection is not a sync psycopg.Connection: on a psycopg.AsyncConnection use the async API, consumer_sdk.write_event_async / write_events_async (consumer_sdk.aio)."""


class ConnectionClosed(OutboxSdkError, psycopg.OperationalError):
    """The connection is closed: nothing was written; its transaction, if any, is gone: run it again on an open connection."""



def require_transaction(autocommit: bool, status: TransactionStatus) -> None:
    """Refuse a closed connection (status UNKNOWN), and an autocommit one outside a transaction block."""
    if status == TransactionStatus.UNKNOWN:
        raise ConnectionClosed()
    if autocommit and status == TransactionStatus.IDLE:
        raise TransactionRequired()


def require_sync_connection(conn: Any) -> None:
    """Refuse None, a ``psycopg.AsyncConnection`` or any object whose ``execute`` is a
    coroutine function: its statements would never run while an id came back."""
    if isinstance(conn, psycopg.Connection):
        return
    if conn is None or isinstance(conn, psycopg.AsyncConnection) or \
            not callable(getattr(conn, "execute", None)) or inspect.iscoroutinefunction(conn.execute):
        raise WrongConnection("conn must be a sync psycopg.Connection, not "
                              f"{'None' if conn is None else type(conn).__name__}: on a "
                              "psycopg.AsyncConnection use consumer_sdk.write_event_async / "
                              "write_events_async (consumer_sdk.aio)")


def _ran(result: Any) -> None:
    """An ``execute`` that returned an awaitable did not run its statement: refuse it."""
    if inspect.isawaitable(result):
        close = getattr(result, "close", None)
        if callable(close):
            close()
        raise WrongConnection()



def write_events(conn: psycopg.Connection[Any], events: Sequence[OutboxEvent], *,
                 wake_relay: bool = True) -> list[uuid.UUID]:
    """Insert ``events`` in one statement, in the caller's transaction; returns their ids in order.

    ``wake_relay=False`` leaves out the notification that wakes a sleeping relay, for a
    transaction that will be prepared (``conn.tpc_prepare()``, ``PREPARE TRANSACTION``):
    PostgreSQL refuses to prepare one that notified.  The relay then finds the rows at its
    poll (``--poll-interval-s``) once the transaction commits.  Needs migration 0014.
    """
    require_sync_connection(conn)
    prepared = prepare(events)
    if not prepared.event_ids:
        return []
    deferred = getattr(conn, "deferred", None)  # a worker pool's connection in ctx.fenced_transaction()
    if getattr(conn, "closed", False) is True or deferred is None or not deferred.pending:  # pending: BEGIN, fence
        require_transaction(conn.autocommit, conn.info.transaction_status)  # closed: ConnectionClosed
    with insert_errors():
        if not wake_relay:
            _ran(conn.execute(query("sdk_outbox", "leave_relay_asleep")))
        _ran(conn.execute(query("sdk_outbox", "insert_events"), prepared.params))
    return prepared.event_ids


#: The unique constraint on the outbox's event_id (0001_outbox.sql, and its partitioned
#: twin, whose partitions' indexes PostgreSQL names "<partition>_event_id_created_at_key").
EVENT_ID_CONSTRAINT = "outbox_event_id_unique"


@contextmanager
def insert_errors() -> Iterator[None]:
    """The driver's errors of the events' insert as the SDK's, for write_events and its
    asyncio twin (consumer_sdk.aio): no outbox table is :class:`SchemaMissing`; an event_id
    the outbox holds already (PostgreSQL names it in its detail, "Key (event_id)=(...)
    already exists.") is :class:`DuplicateEvent`.  Another unique constraint's refusal is
    raised unchanged."""
    try:
        yield
    except psycopg.errors.UndefinedTable as exc:
        raise SchemaMissing() from exc
    except psycopg.errors.UniqueViolation as exc:
        name = exc.diag.constraint_name
        if name != EVENT_ID_CONSTRAINT and name != f"{exc.diag.table_name}_event_id_created_at_key":
            raise
        raise DuplicateEvent(f"{exc.diag.message_detail or 'an event_id is in the outbox already.'} "
                             "Each event is written once (write_events returns the ids it wrote); "
                             "the transaction is aborted: roll it back") from exc


def write_event(
    conn: psycopg.Connection[Any],
    *,
    topic: str,
    key: str | None,
    payload: Any,
    headers: Mapping[str, str | None] | None = None,
    traceparent: str | None = None,
    tracestate: str | None = None,
    event_id: uuid.UUID | str | None = None,
    wake_relay: bool = True,
) -> uuid.UUID:
    """Insert one event in the caller's transaction; returns its ``event_id``. Never commits.

    ``event_id`` may be a ``uuid.UUID`` or its text (``"{96122457-773D-...}"`` too); the
    ``uuid.UUID`` returned is the one stored.  Bad arguments raise :class:`InvalidEvent`
    before any SQL (see the module docstring).
    ``wake_relay=False``: in a transaction that will be prepared (see ``write_events``)."""
    event = OutboxEvent(topic=topic, key=key, payload=payload, headers=headers,
                        traceparent=traceparent, tracestate=tracestate, event_id=event_id)
    return write_events(conn, [event], wake_relay=wake_relay)[0]
