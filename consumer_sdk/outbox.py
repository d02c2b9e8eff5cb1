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

The asyncio twins live in :mod:`consumer_sdk.aio` and share :func:`prepare`.

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
import json
import os
import re
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
import psycopg.errors
import structlog
from psycopg.pq import TransactionStatus

from consumer_sdk.errors import (
    DuplicateEvent,
    InvalidEvent,
    OutboxSdkError,
    SchemaMissing,
    TransactionRequired,
)
from consumer_sdk.model import EVENT_ID_HEADER, valid_topic_name
from consumer_sdk.replays import REPLAY_HEADER
from outbox_core.queries import query
from outbox_core.text import has_colliding_keys, refuse_unstorable, uuid_from_text

_log = structlog.get_logger("consumer_sdk.outbox")

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
TRACEPARENT_HEADER = "traceparent"
TRACESTATE_HEADER = "tracestate"
#: The longest tracestate kept (W3C: 32 list members; longer is dropped, never refused).
MAX_TRACESTATE_CHARS = 512


@dataclass(frozen=True, kw_only=True)
class OutboxEvent:
    """One event to write.  ``event_id`` is generated (:func:`new_event_id`) when not given."""

    topic: str
    key: str | None
    payload: Any
    headers: Mapping[str, str | None] | None = None
    traceparent: str | None = None
    tracestate: str | None = None
    event_id: uuid.UUID | str | None = None


@dataclass(frozen=True, slots=True)
class Prepared:
    """The statement parameters of a batch of events, and their ids in order."""

    event_ids: list[uuid.UUID]
    params: dict[str, list[Any]]


_TIME_MASK = (1 << 48) - 1
_RAND_B_MASK = (1 << 62) - 1
_VERSION_7 = 0x7 << 76
_VARIANT_RFC = 0b10 << 62


def new_event_id() -> uuid.UUID:
    """A fresh event id: a version 7 UUID (RFC 9562), the Unix time in milliseconds in its
    first 48 bits and 74 random bits after the version and variant, as PostgreSQL 18's
    ``uuidv7()`` and the outbox's column default make them.  Ids made later sort later
    (within one millisecond, in any order); like ``created_at``, an id tells when it was
    made."""
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")  # 80 bits: 12 for rand_a, 62 for rand_b
    return uuid.UUID(int=((millis & _TIME_MASK) << 80) | _VERSION_7 | ((rand >> 68) << 64)
                     | _VARIANT_RFC | (rand & _RAND_B_MASK))


def valid_traceparent(value: str) -> bool:
    """A W3C ``traceparent`` of a known shape, not the invalid all-zero ids or version ff."""
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return False
    version, trace_id, parent_id, _flags = match.groups()
    return version != "ff" and trace_id != "0" * 32 and parent_id != "0" * 16


class WrongConnection(InvalidEvent, TypeError):
    """The connection is not a sync psycopg.Connection: on a psycopg.AsyncConnection use the async API, consumer_sdk.write_event_async / write_events_async (consumer_sdk.aio)."""


class ConnectionClosed(OutboxSdkError, psycopg.OperationalError):
    """The connection is closed: nothing was written; its transaction, if any, is gone: run it again on an open connection."""


def kept_tracestate(tracestate: str | None) -> str | None:
    """The ``tracestate`` stored beside a valid traceparent, or None: one longer than
    ``MAX_TRACESTATE_CHARS`` or that PostgreSQL cannot store (a NUL character, a lone
    surrogate) is dropped, never refused.  Events and jobs keep the same (a NUL in an event's
    tracestate failed the business transaction, where a job's was dropped)."""
    if tracestate is None or len(tracestate) > MAX_TRACESTATE_CHARS:
        return None
    try:
        return refuse_unstorable("tracestate", tracestate, ValueError)
    except ValueError:
        return None


def _storable(name: str, value: str) -> None:
    refuse_unstorable(name, value, InvalidEvent)


def _json_storable(name: str, encoded: str) -> str:
    return refuse_unstorable(name, encoded, InvalidEvent, json=True)


def encode_payload(payload: Any) -> tuple[str | None, bytes | None]:
    """``(json_text, raw_bytes)``: at most one is set; both None is a tombstone.

    JSON payloads follow json.dumps (dict keys may be str, int, float, bool or None,
    written as strings), except that keys colliding once stringified (``{1: "a", "1": "b"}``)
    are refused rather than collapsed by jsonb, as are NaN/Infinity, NUL characters and lone
    surrogates in strings, and nesting too deep to encode."""
    if payload is None:
        return None, None
    if isinstance(payload, bytes | bytearray | memoryview):
        return None, bytes(payload)
    try:
        text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidEvent(f"the payload is neither bytes nor JSON-encodable: {exc}") from None
    except RecursionError:
        raise InvalidEvent("the payload is nested too deeply to encode as JSON") from None
    _json_storable("the payload", text)
    if has_colliding_keys(payload):
        raise InvalidEvent("the payload has a dict whose keys collide once converted to JSON strings "
                           "(like 1 and '1'): keys must be distinct as strings")
    return text, None


def _trace_argument(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidEvent(f"{name} must be None or a str, not {type(value).__name__}")
    return value


def _one_trace_value(name: str, argument: str | None, header: str | None) -> str | None:
    """The argument or the header of the same name; refused when both are given and differ."""
    if argument is not None and header is not None and argument != header:
        raise InvalidEvent(f"{name} is given both as an argument and in headers, with different "
                           f"values: give it once")
    return argument if argument is not None else header


def encode_headers(event: OutboxEvent) -> str:
    """The headers as a JSON object of strings, with the trace context when it is valid.

    ``headers`` must be a mapping of non-empty str names to str (or None) values, without
    the two the relay sets (``event_id``, ``replay_id``).  A
    ``traceparent``/``tracestate`` given in ``headers`` is treated like the argument of the
    same name (giving both with different values is refused).  Trace context never fails
    the business transaction: an invalid traceparent is dropped, with its tracestate, and
    logged; a tracestate without a traceparent, too long or unstorable is dropped."""
    if event.headers is not None and not isinstance(event.headers, Mapping):
        raise InvalidEvent("headers must be None or a mapping of str names to str (or None) values, "
                           f"not {type(event.headers).__name__}")
    traceparent = _trace_argument("traceparent", event.traceparent)
    tracestate = _trace_argument("tracestate", event.tracestate)
    headers: dict[str, str | None] = {}
    for name, value in (event.headers or {}).items():
        if not isinstance(name, str) or not name:
            raise InvalidEvent(f"header names must be non-empty strings, got {type(name).__name__}")
        _storable("a header name", name)
        if name == EVENT_ID_HEADER:
            raise InvalidEvent("the event_id header is reserved: pass event_id= instead")
        if name == REPLAY_HEADER:  # a consumer applying that replay would apply the event again
            raise InvalidEvent("the replay_id header is reserved: the relay sets it on the events "
                               "it republishes (outbox-relay replay)")
        if value is not None and not isinstance(value, str):
            raise InvalidEvent(f"header {name!r} must be a string or None, not {type(value).__name__}")
        if value is not None and name not in (TRACEPARENT_HEADER, TRACESTATE_HEADER):
            _storable(f"header {name!r}", value)  # the trace context's are kept or dropped below
        headers[name] = value
    if event.headers is not None:
        traceparent = _one_trace_value(TRACEPARENT_HEADER, traceparent, headers.get(TRACEPARENT_HEADER))
        tracestate = _one_trace_value(TRACESTATE_HEADER, tracestate, headers.get(TRACESTATE_HEADER))
    # The trace headers are the trace context's: kept only beside a valid traceparent (W3C:
    # a tracestate without one means nothing), whether given as arguments or in headers.
    headers.pop(TRACEPARENT_HEADER, None)
    headers.pop(TRACESTATE_HEADER, None)
    if traceparent is not None:
        if valid_traceparent(traceparent):
            headers[TRACEPARENT_HEADER] = traceparent
            tracestate = kept_tracestate(tracestate)
            if tracestate:
                headers[TRACESTATE_HEADER] = tracestate
        else:  # a broken trace header must not fail the business transaction
            _log.warning("trace_context_invalid", traceparent=traceparent[:100])
    return _json_storable("headers", json.dumps(headers, separators=(",", ":"), ensure_ascii=False))


def _check(event: OutboxEvent) -> None:
    if not valid_topic_name(event.topic):
        shown = repr(event.topic) if isinstance(event.topic, str) else type(event.topic).__name__
        raise InvalidEvent(f"invalid Kafka topic name {shown[:120]}: 1-249 of [A-Za-z0-9._-], "
                           "not '.' or '..'")
    if event.key is not None:
        if not isinstance(event.key, str):
            raise InvalidEvent("the key must be a str without NUL characters, or None, "
                               f"not {type(event.key).__name__}")
        _storable("the key", event.key)


def _event_id(value: Any) -> uuid.UUID:
    """The event id to store: given (a ``uuid.UUID`` or its text, canonicalized) or new."""
    if value is None:
        return new_event_id()
    if isinstance(value, uuid.UUID):
        return value
    parsed = uuid_from_text(value)
    if parsed is not None:
        return parsed
    raise InvalidEvent("event_id must be None, a uuid.UUID or a UUID's text (32 hex digits, "
                       f"optionally hyphenated or in braces), not this {type(value).__name__}")


def prepare(events: Iterable[OutboxEvent]) -> Prepared:
    """Validate and encode events into the ``insert_events`` parameters (no I/O).

    An event id may be given as a ``uuid.UUID`` or its text; the ``uuid.UUID`` stored is the
    one returned.  The same id twice in one batch is refused."""
    events = _event_list(events)
    ids: list[uuid.UUID] = []
    seen: set[uuid.UUID] = set()
    params: dict[str, list[Any]] = {
        "event_ids": [], "topics": [], "keys": [], "payloads": [], "payloads_bytes": [], "headers": [],
    }
    for event in events:
        if not isinstance(event, OutboxEvent):
            raise InvalidEvent(f"events must be OutboxEvent instances, not {type(event).__name__}")
        _check(event)
        event_id = _event_id(event.event_id)
        if event_id in seen:
            raise InvalidEvent(f"event_id {event_id} is given twice in one batch: event ids are unique")
        seen.add(event_id)
        text, raw = encode_payload(event.payload)
        headers = encode_headers(event)
        ids.append(event_id)
        params["event_ids"].append(event_id)
        params["topics"].append(event.topic)
        params["keys"].append(event.key)
        params["payloads"].append(text)
        params["payloads_bytes"].append(raw)
        params["headers"].append(headers)
    return Prepared(ids, params)


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


def _event_list(events: Any) -> Any:
    if events is None or isinstance(events, OutboxEvent | str | bytes | Mapping) or \
            not isinstance(events, Iterable):
        raise InvalidEvent("events must be a sequence of OutboxEvent, not "
                           f"{'None' if events is None else type(events).__name__}")
    return events


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
