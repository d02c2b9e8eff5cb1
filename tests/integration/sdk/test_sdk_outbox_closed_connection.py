"""write_event on a connection that is closed (closed by the caller, or found lost by psycopg):
the SDK's own error saying so and that nothing was written, before any SQL.  It raised
psycopg's bare "the connection is closed", which named neither the outbox nor what became of
the event.  The error is also a ``psycopg.OperationalError``: code that caught psycopg's
still does."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from consumer_sdk import (
    ConnectionClosed,
    OutboxSdkError,
    write_event,
    write_event_async,
    write_events,
)
from consumer_sdk.outbox import OutboxEvent


def _count(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM outbox").fetchone()
    assert row is not None
    return int(row[0])


def _assert_clear(error: BaseException) -> None:
    assert isinstance(error, ConnectionClosed) and isinstance(error, OutboxSdkError), repr(error)
    assert isinstance(error, psycopg.OperationalError), repr(error)  # what callers caught before
    assert "connection is closed" in str(error) and "nothing was written" in str(error), str(error)


@pytest.mark.parametrize("autocommit", [True, False], ids=["autocommit", "transactional"])
def test_a_closed_connection_is_named_and_nothing_is_written(sdk_db: str, autocommit: bool) -> None:
    conn = psycopg.connect(sdk_db, autocommit=autocommit)
    conn.close()
    with pytest.raises(psycopg.Error) as caught:  # before: psycopg's OperationalError alone
        write_event(conn, topic="orders", key="o-1", payload={"n": 1})
    _assert_clear(caught.value)
    with pytest.raises(ConnectionClosed):
        write_events(conn, [OutboxEvent(topic="orders", key="o-2", payload=None)], wake_relay=False)
    assert _count(sdk_db) == 0


def test_a_connection_lost_in_a_transaction_is_named(sdk_db: str) -> None:
    """The server ended the session; psycopg noticed at the caller's next statement."""
    conn = psycopg.connect(sdk_db)
    pid = conn.info.backend_pid
    with psycopg.connect(sdk_db, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    with pytest.raises(psycopg.OperationalError):
        conn.execute("SELECT 1")
    assert conn.closed
    with pytest.raises(ConnectionClosed) as caught:
        write_event(conn, topic="orders", key="o-1", payload={"n": 1})
    _assert_clear(caught.value)
    assert _count(sdk_db) == 0


def test_the_async_twin_names_a_closed_connection(sdk_db: str) -> None:
    async def scenario() -> Any:
        conn = await psycopg.AsyncConnection.connect(sdk_db)
        await conn.close()
        with pytest.raises(psycopg.Error) as caught:
            await write_event_async(conn, topic="orders", key="o-1", payload={"n": 1})
        return caught.value

    _assert_clear(asyncio.run(scenario()))
    assert _count(sdk_db) == 0


def test_an_open_connection_still_writes(sdk_db: str) -> None:
    with psycopg.connect(sdk_db) as conn:
        write_event(conn, topic="orders", key="o-1", payload={"n": 1})
        conn.commit()
    assert _count(sdk_db) == 1
