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
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import psycopg.errors
import structlog
from psycopg.pq import TransactionStatus

from consumer_sdk.errors import InvalidEvent, SchemaMissing, TransactionRequired
from consumer_sdk.model import EVENT_ID_HEADER
from outbox_core.queries import query

_log = structlog.get_logger("consumer_sdk.outbox")

_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
TRACEPARENT_HEADER = "traceparent"
TRACESTATE_HEADER = "tracestate"
_MAX_TRACESTATE_CHARS = 512


@dataclass(frozen=True, kw_only=True)
class OutboxEvent:
    """One event to write.  ``event_id`` is generated (:func:`new_event_id`) when not given."""

    topic: str
    key: str | None
    payload: Any
    headers: Mapping[str, str | None] | None = None
    traceparent: str | None = None
    tracestate: str | None = None
    event_id: uuid.UUID | None = None


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
    match = _TRACEPARENT.match(value)
    if match is None:
        return False
    version, trace_id, parent_id, _flags = match.groups()
    return version != "ff" and trace_id != "0" * 32 and parent_id != "0" * 16


def encode_payload(payload: Any) -> tuple[str | None, bytes | None]:
    """``(json_text, raw_bytes)``: at most one is set; both None is a tombstone."""
    if payload is None:
        return None, None
    if isinstance(payload, bytes | bytearray | memoryview):
        return None, bytes(payload)
    try:
        return json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False), None
    except (TypeError, ValueError) as exc:
        raise InvalidEvent(f"the payload is neither bytes nor JSON-encodable: {exc}") from None


def encode_headers(event: OutboxEvent) -> str:
    """The headers as a JSON object of strings, with the trace context when it is valid."""
    headers: dict[str, str | None] = {}
    for name, value in (event.headers or {}).items():
        if not isinstance(name, str) or not name:
            raise InvalidEvent(f"header names must be non-empty strings, got {name!r}")
        if name == EVENT_ID_HEADER:
            raise InvalidEvent("the event_id header is reserved: pass event_id= instead")
        if value is not None and not isinstance(value, str):
            raise InvalidEvent(f"header {name!r} must be a string or None, not {type(value).__name__}")
        headers[name] = value
    if event.traceparent is not None:
        if valid_traceparent(event.traceparent):
            headers[TRACEPARENT_HEADER] = event.traceparent
            if event.tracestate and len(event.tracestate) <= _MAX_TRACESTATE_CHARS:
                headers[TRACESTATE_HEADER] = event.tracestate
        else:  # a broken trace header must not fail the business transaction
            _log.warning("trace_context_invalid", traceparent=event.traceparent[:100])
    return json.dumps(headers, separators=(",", ":"), ensure_ascii=False)


def _check(event: OutboxEvent) -> None:
    if not isinstance(event.topic, str) or not _TOPIC.match(event.topic) or event.topic in (".", ".."):
        raise InvalidEvent(f"invalid Kafka topic name {event.topic!r}: 1-249 of [A-Za-z0-9._-]")
    if event.key is not None and (not isinstance(event.key, str) or "\x00" in event.key):
        raise InvalidEvent("the key must be a str without NUL characters, or None")


def prepare(events: Iterable[OutboxEvent]) -> Prepared:
    """Validate and encode events into the ``insert_events`` parameters (no I/O)."""
    ids: list[uuid.UUID] = []
    params: dict[str, list[Any]] = {
        "event_ids": [], "topics": [], "keys": [], "payloads": [], "payloads_bytes": [], "headers": [],
    }
    for event in events:
        _check(event)
        event_id = event.event_id or new_event_id()
        text, raw = encode_payload(event.payload)
        ids.append(event_id)
        params["event_ids"].append(event_id)
        params["topics"].append(event.topic)
        params["keys"].append(event.key)
        params["payloads"].append(text)
        params["payloads_bytes"].append(raw)
        params["headers"].append(encode_headers(event))
    return Prepared(ids, params)


def require_transaction(autocommit: bool, status: TransactionStatus) -> None:
    """Refuse an autocommit connection outside a transaction block: the row would commit alone."""
    if autocommit and status == TransactionStatus.IDLE:
        raise TransactionRequired()


def write_events(conn: psycopg.Connection[Any], events: Sequence[OutboxEvent], *,
                 wake_relay: bool = True) -> list[uuid.UUID]:
    """Insert ``events`` in one statement, in the caller's transaction; returns their ids in order.

    ``wake_relay=False`` leaves out the notification that wakes a sleeping relay, for a
    transaction that will be prepared (``conn.tpc_prepare()``, ``PREPARE TRANSACTION``):
    PostgreSQL refuses to prepare one that notified.  The relay then finds the rows at its
    poll (``--poll-interval-s``) once the transaction commits.  Needs migration 0014.
    """
    prepared = prepare(events)
    if not prepared.event_ids:
        return []
    require_transaction(conn.autocommit, conn.info.transaction_status)
    try:
        if not wake_relay:
            conn.execute(query("sdk_outbox", "leave_relay_asleep"))
        conn.execute(query("sdk_outbox", "insert_events"), prepared.params)
    except psycopg.errors.UndefinedTable as exc:
        raise SchemaMissing() from exc
    return prepared.event_ids


def write_event(
    conn: psycopg.Connection[Any],
    *,
    topic: str,
    key: str | None,
    payload: Any,
    headers: Mapping[str, str | None] | None = None,
    traceparent: str | None = None,
    tracestate: str | None = None,
    event_id: uuid.UUID | None = None,
    wake_relay: bool = True,
) -> uuid.UUID:
    """Insert one event in the caller's transaction; returns its ``event_id``. Never commits.

    ``wake_relay=False``: in a transaction that will be prepared (see ``write_events``)."""
    event = OutboxEvent(topic=topic, key=key, payload=payload, headers=headers,
                        traceparent=traceparent, tracestate=tracestate, event_id=event_id)
    return write_events(conn, [event], wake_relay=wake_relay)[0]
