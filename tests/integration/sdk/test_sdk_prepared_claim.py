"""Issue 19: one message at a time, the claim is the connection's prepared statement (no
parsing or planning on the server), run after [COMMIT;] BEGIN; in one simple query.  Should it
vanish (a handler's DEALLOCATE or DISCARD ALL, a pooler moving the session), that round trip
fails as any other: retriable, its deferred COMMIT's records unsettled, and the retry uses the
plain claim; nothing is applied twice."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest
import structlog

from consumer_sdk.errors import TransactionConflict
from consumer_sdk.metrics import ConsumerMetrics
from consumer_sdk.model import InboxMessage, KafkaRecord
from consumer_sdk.processor import Policies, Processor
from consumer_sdk.store import PgInboxStore, connect_factory
from consumer_sdk.testing import FakeDeadLetters, make_record

EFFECTS = "CREATE TABLE IF NOT EXISTS prepared_effects (event_id uuid NOT NULL, n int NOT NULL)"
PREPARED = "SELECT name FROM pg_prepared_statements WHERE name = 'outbox_inbox_claim_v1'"


def _processor(store: PgInboxStore, handler: Any, settled: list[KafkaRecord]) -> Processor:
    return Processor(consumer=f"pc-{uuid.uuid4().hex[:6]}", store=store, handler=handler,
                     dead_letters=FakeDeadLetters(), policies=Policies(), metrics=ConsumerMetrics(),
                     log=structlog.get_logger("tests.sdk"), sleep=lambda s: None, on_settled=settled.extend,
                     batch_size=1)


def insert_n(conn: Any, message: InboxMessage) -> None:
    conn.execute("INSERT INTO prepared_effects VALUES (%s, %s)", (message.event_id, message.json()["n"]))


def _effects(sdk_db: str, records: list[KafkaRecord]) -> list[int]:
    ids = [uuid.UUID(dict(r.headers)["event_id"].decode()) for r in records]
    with psycopg.connect(sdk_db, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT n FROM prepared_effects WHERE event_id = ANY(%s) ORDER BY n",
                                           (ids,)).fetchall()]


def test_one_at_a_time_claims_with_the_connections_prepared_statement(sdk_db):
    store = PgInboxStore(connect_factory(sdk_db))
    store.conn.execute(EFFECTS)
    settled: list[KafkaRecord] = []
    records = [make_record(value={"n": n}, offset=n) for n in range(3)]
    try:
        assert store.conn.execute(PREPARED).fetchone() is None
        assert _processor(store, insert_n, settled).process(records).applied == 3
        assert store.conn.execute(PREPARED).fetchone() is not None
        assert settled == records and _effects(sdk_db, records) == [0, 1, 2]
    finally:
        store.close()


def test_a_vanished_prepared_claim_is_retried_with_the_plain_claim_and_applies_once(sdk_db):
    store = PgInboxStore(connect_factory(sdk_db))
    store.conn.execute(EFFECTS)
    settled: list[KafkaRecord] = []

    def handler(conn: Any, message: InboxMessage) -> None:
        insert_n(conn, message)
        if message.json()["n"] == 1:
            conn.execute("DEALLOCATE outbox_inbox_claim_v1")

    processor = _processor(store, handler, settled)
    records = [make_record(value={"n": n}, offset=n) for n in range(4)]
    try:
        with pytest.raises(TransactionConflict):
            processor.process(records)
        # The second record's COMMIT went in the round trip that failed: committed, yet unsettled.
        assert settled == records[:1]
        result = processor.process(records[1:])  # what was left unsettled, delivered again
        assert (result.applied, result.duplicates) == (2, 1)
        assert settled == records
        assert _effects(sdk_db, records) == [0, 1, 2, 3]
        assert store.conn.execute(PREPARED).fetchone() is None  # not prepared again on this store
    finally:
        store.close()
