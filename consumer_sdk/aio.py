"""asyncio twins of :mod:`consumer_sdk.outbox`, for ``psycopg.AsyncConnection``.

Same guarantee and rules: the insert runs in the caller's transaction and never
commits.  Validation and encoding are shared (:func:`consumer_sdk.outbox.prepare`);
only the await differs.  A connection that is not a ``psycopg.AsyncConnection`` (a sync
``psycopg.Connection``, None) raises :class:`~consumer_sdk.outbox.WrongConnection` before
any SQL: a sync connection would write the row and then fail at the await.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg

from consumer_sdk.outbox import (
    OutboxEvent,
    WrongConnection,
    insert_errors,
    prepare,
    require_transaction,
)
from outbox_core.queries import query


async def write_events(conn: psycopg.AsyncConnection[Any], events: Sequence[OutboxEvent], *,
                       wake_relay: bool = True) -> list[uuid.UUID]:
    """:func:`consumer_sdk.outbox.write_events` on an async connection (``wake_relay`` too)."""
    if not isinstance(conn, psycopg.AsyncConnection):
        raise WrongConnection("conn must be a psycopg.AsyncConnection, not "
                              f"{'None' if conn is None else type(conn).__name__}: on a sync "
                              "psycopg.Connection use consumer_sdk.write_event / write_events")
    prepared = prepare(events)
    if not prepared.event_ids:
        return []
    require_transaction(conn.autocommit, conn.info.transaction_status)
    with insert_errors():
        if not wake_relay:
            await conn.execute(query("sdk_outbox", "leave_relay_asleep"))
        await conn.execute(query("sdk_outbox", "insert_events"), prepared.params)
    return prepared.event_ids


async def write_event(
    conn: psycopg.AsyncConnection[Any],
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

    ``wake_relay=False``: in a transaction that will be prepared (see ``write_events``)."""
    event = OutboxEvent(topic=topic, key=key, payload=payload, headers=headers,
                        traceparent=traceparent, tracestate=tracestate, event_id=event_id)
    return (await write_events(conn, [event], wake_relay=wake_relay))[0]
