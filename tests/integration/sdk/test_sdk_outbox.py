"""The producing side on a real PostgreSQL: events commit with the caller's transaction,
and the relay delivers them with their headers and trace context."""

from __future__ import annotations

import asyncio
import json
import uuid

import psycopg
import pytest

from consumer_sdk import (
    DuplicateEvent,
    InboxMessage,
    OutboxEvent,
    SchemaMissing,
    TransactionRequired,
    write_event,
    write_event_async,
    write_events,
    write_events_async,
)
from relay.wakeup import Wakeup
from tests.fixtures.broker import read_all
from tests.fixtures.outbox import needs_prepared_transactions
from tests.integration.sdk._support import make_config, publish_all, wait_settled

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _rows(dsn: str) -> list[tuple]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT event_id, topic, key, payload, payload_bytes, headers FROM outbox ORDER BY id").fetchall()


def test_event_commits_with_the_callers_transaction(sdk_db):
    with psycopg.connect(sdk_db, autocommit=True) as conn:
        with conn.transaction():
            event_id = write_event(conn, topic="orders", key="o-1", payload={"total": 12.5},
                                   headers={"tenant": "acme"}, traceparent=TRACEPARENT, tracestate="v=1")
            with psycopg.connect(sdk_db, autocommit=True) as other:  # not visible before the commit
                assert other.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
    [(stored_id, topic, key, payload, raw, headers)] = _rows(sdk_db)
    assert (stored_id, topic, key, payload, raw) == (event_id, "orders", "o-1", {"total": 12.5}, None)
    assert headers == {"tenant": "acme", "traceparent": TRACEPARENT, "tracestate": "v=1"}


def test_a_rolled_back_transaction_leaves_no_event(sdk_db):
    with psycopg.connect(sdk_db, autocommit=True) as conn:
        with pytest.raises(RuntimeError), conn.transaction():
            write_event(conn, topic="orders", key="o-1", payload={"n": 1})
            raise RuntimeError("the business change failed")
    with psycopg.connect(sdk_db) as conn:  # a non-autocommit connection: the caller commits
        write_event(conn, topic="orders", key="o-2", payload={"n": 2})
        conn.rollback()
        write_event(conn, topic="orders", key="o-3", payload={"n": 3})
        conn.commit()
    assert [r[2] for r in _rows(sdk_db)] == ["o-3"]


def test_an_autocommit_connection_outside_a_transaction_is_refused(sdk_db):
    with psycopg.connect(sdk_db, autocommit=True) as conn:
        with pytest.raises(TransactionRequired):
            write_event(conn, topic="orders", key=None, payload={"n": 1})
    assert _rows(sdk_db) == []


def test_write_events_is_one_statement_in_list_order(sdk_db):
    events = [
        OutboxEvent(topic="orders", key="k", payload={"n": 1}),
        OutboxEvent(topic="orders", key="k", payload=b"\x00\x01avro"),
        OutboxEvent(topic="orders", key="k", payload=None),
        OutboxEvent(topic="audit", key=None, payload="plain string", event_id=uuid.UUID(int=7)),
    ]
    with psycopg.connect(sdk_db) as conn:
        ids = write_events(conn, events)
        assert write_events(conn, []) == []
    rows = _rows(sdk_db)
    assert [r[0] for r in rows] == ids and ids[3] == uuid.UUID(int=7)
    assert [(r[3], r[4]) for r in rows] == [({"n": 1}, None), (None, b"\x00\x01avro"), (None, None),
                                            ("plain string", None)]
    with psycopg.connect(sdk_db) as conn:  # one transaction, one statement: one xid, one NOTIFY
        xids = conn.execute("SELECT count(DISTINCT xid) FROM outbox").fetchone()
    assert xids == (1,)


def test_an_event_id_written_before_is_a_duplicate_event_not_a_driver_error(sdk_db):
    """Writing an event_id the outbox holds already (a retried request whose event was
    committed) raised psycopg's UniqueViolation, the one driver error the SDK's writes let
    through; now DuplicateEvent (an OutboxSdkError) names the id and says the transaction
    is aborted."""
    with psycopg.connect(sdk_db) as conn:
        event_id = write_event(conn, topic="orders", key="o-1", payload={"n": 1})
        conn.commit()
        with pytest.raises(DuplicateEvent, match=f"{event_id}.*written once.*aborted") as caught:
            write_events(conn, [OutboxEvent(topic="orders", key="o-2", payload={"n": 2}),
                                OutboxEvent(topic="orders", key="o-1", payload={"n": 3}, event_id=event_id)])
        assert isinstance(caught.value.__cause__, psycopg.errors.UniqueViolation)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
        conn.rollback()
        write_event(conn, topic="orders", key="o-3", payload={"n": 4})  # usable after the rollback
        conn.commit()

    async def twin() -> None:
        async with await psycopg.AsyncConnection.connect(sdk_db) as conn:
            with pytest.raises(DuplicateEvent, match=str(event_id)):
                await write_event_async(conn, topic="orders", key="o-1", payload={}, event_id=str(event_id))
            await conn.rollback()

    asyncio.run(twin())
    assert [(r[2], r[3]) for r in _rows(sdk_db)] == [("o-1", {"n": 1}), ("o-3", {"n": 4})]


def test_an_unmigrated_database_gives_schema_missing(db_dsn):
    with psycopg.connect(db_dsn) as conn, pytest.raises(SchemaMissing):
        write_event(conn, topic="orders", key=None, payload={})


def test_async_twins_write_in_the_callers_transaction(sdk_db):
    async def scenario() -> list[uuid.UUID]:
        async with await psycopg.AsyncConnection.connect(sdk_db, autocommit=True) as conn:
            with pytest.raises(TransactionRequired):
                await write_event_async(conn, topic="orders", key=None, payload={})
            async with conn.transaction():
                first = await write_event_async(conn, topic="orders", key="a", payload={"n": 1},
                                                traceparent=TRACEPARENT)
                more = await write_events_async(conn, [OutboxEvent(topic="orders", key="a", payload={"n": 2})])
            return [first, *more]

    ids = asyncio.run(scenario())
    rows = _rows(sdk_db)
    assert [r[0] for r in rows] == ids
    assert rows[0][5] == {"traceparent": TRACEPARENT}


def test_a_two_phase_transaction_prepares_beside_a_sleeping_relay_with_wake_relay_off(sdk_db):
    """PostgreSQL refuses to prepare a transaction that ran NOTIFY, and the outbox's trigger
    notifies a sleeping relay.  write_event(..., wake_relay=False) leaves the notification
    out: psycopg's tpc_prepare works and the event commits with tpc_commit, from the sync
    and the async SDK alike.  The relay finds such rows at its poll."""
    needs_prepared_transactions(sdk_db)
    wakeup = Wakeup(sdk_db)  # a relay asleep: it holds the wake-up lock, writers notify
    try:
        assert not wakeup.wait(0.05) and wakeup.set_sleeping(True)
        conn = psycopg.connect(sdk_db)
        try:
            conn.tpc_begin(conn.xid(1, "sdk-refused", "outbox"))
            write_event(conn, topic="orders", key="o-1", payload={"n": 1})
            with pytest.raises(psycopg.errors.FeatureNotSupported, match="NOTIFY"):
                conn.tpc_prepare()  # the failed PREPARE ended the transaction
        finally:
            conn.close()
        assert _rows(sdk_db) == []

        with psycopg.connect(sdk_db) as conn:
            conn.tpc_begin(conn.xid(2, "sdk-sync", "outbox"))
            first = write_event(conn, topic="orders", key="o-1", payload={"n": 1}, wake_relay=False)
            conn.tpc_prepare()
            conn.tpc_commit()

        async def prepared_async() -> list[uuid.UUID]:
            async with await psycopg.AsyncConnection.connect(sdk_db) as conn:
                await conn.tpc_begin(conn.xid(3, "sdk-async", "outbox"))
                ids = await write_events_async(
                    conn, [OutboxEvent(topic="orders", key="o-1", payload={"n": 2})], wake_relay=False)
                await conn.tpc_prepare()
                await conn.tpc_commit()
                return ids

        second = asyncio.run(prepared_async())
        assert [r[0] for r in _rows(sdk_db)] == [first, *second]
        assert not wakeup.wait(0.3)  # nothing notified: the relay's poll finds the rows
    finally:
        wakeup.close()


def test_round_trip_through_the_relay_to_a_handler(sdk_db, broker, sdk_topic, run_consumer):
    with psycopg.connect(sdk_db) as conn:
        json_id = write_event(conn, topic=sdk_topic, key="order-1", payload={"total": 3},
                              headers={"tenant": "acme"}, traceparent=TRACEPARENT)
        bytes_id = write_event(conn, topic=sdk_topic, key="order-1", payload=b"\xffraw")
    publish_all(sdk_db, broker.bootstrap)
    assert len(read_all(broker.bootstrap, sdk_topic, expected=2, timeout_s=20)) == 2
    seen: dict[uuid.UUID, InboxMessage] = {}
    thread = run_consumer(make_config(sdk_db, broker, sdk_topic),
                          lambda conn, message: seen.__setitem__(message.event_id, message))
    wait_settled(thread, 2)
    thread.stop()
    first, second = seen[json_id], seen[bytes_id]
    assert first.json() == {"total": 3} and first.key_text == "order-1"
    assert first.header("tenant") == "acme" and first.header("traceparent") == TRACEPARENT
    assert json.loads(first.value or b"") == {"total": 3}
    assert second.value == b"\xffraw" and second.partition == first.partition
