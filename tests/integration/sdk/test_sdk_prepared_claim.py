"""Issue 19: one message at a time, the claim that opens each transaction goes as the
connection's prepared statement, after the deferred COMMIT and BEGIN in one libpq pipeline
(consumer_sdk/_wire.py), not as a simple query bound on the client.  When the prepared
statement is gone (DISCARD ALL, DEALLOCATE, a pooler), it is prepared again and the claim
retried, nothing is lost or applied twice, and after three losses in a row the store claims
through a cursor for good."""

from __future__ import annotations

import json
import uuid
from typing import Any

import structlog

from consumer_sdk.metrics import ConsumerMetrics
from consumer_sdk.model import InboxMessage, KafkaRecord
from consumer_sdk.processor import Policies, Processor
from consumer_sdk.store import CLAIM_STATEMENT, PgInboxStore, connect_factory
from consumer_sdk.testing import FakeDeadLetters, make_record
from tests.integration.sdk._support import RoundTrips

EFFECTS = "CREATE TABLE IF NOT EXISTS pc_effects (event_id uuid NOT NULL, n int NOT NULL)"


def _setup(sdk_db: str) -> tuple[PgInboxStore, Processor, list[KafkaRecord]]:
    store = PgInboxStore(connect_factory(sdk_db))
    store.conn.execute(EFFECTS)
    settled: list[KafkaRecord] = []

    def handler(conn: Any, message: InboxMessage) -> None:
        conn.execute("INSERT INTO pc_effects VALUES (%s, %s)", (message.event_id, message.json()["n"]))

    processor = Processor(consumer=f"pc-{uuid.uuid4().hex[:6]}", store=store, handler=handler,
                          dead_letters=FakeDeadLetters(), policies=Policies(), metrics=ConsumerMetrics(),
                          log=structlog.get_logger("tests.sdk"), sleep=lambda s: None,
                          on_settled=settled.extend, batch_size=1)
    return store, processor, settled


def _records(n: int) -> list[KafkaRecord]:
    return [make_record(value={"n": i}, offset=i) for i in range(n)]


def _effects(store: PgInboxStore, records: list[KafkaRecord]) -> dict[int, int]:
    ns = [json.loads(r.value)["n"] for r in records]
    rows = store.conn.execute("SELECT n, count(*) FROM pc_effects WHERE n = ANY(%s) GROUP BY n", (ns,)).fetchall()
    return dict(rows)


def _prepared(store: PgInboxStore) -> int:
    row = store.conn.execute("SELECT count(*) FROM pg_prepared_statements WHERE name = %s",
                             (CLAIM_STATEMENT.decode(),)).fetchone()
    assert row is not None
    return int(row[0])


def _deallocate(store: PgInboxStore) -> None:
    """Drop the prepared claim, as DISCARD ALL (or psycopg's DEALLOCATE ALL) would."""
    store.conn.execute(f"DEALLOCATE {CLAIM_STATEMENT.decode()}")


def _text_claims(trips: RoundTrips) -> list[str]:
    return [s for s in trips.sent if "INSERT INTO outbox_inbox" in s]


def test_one_at_a_time_claims_with_the_prepared_statement(sdk_db):
    store, processor, settled = _setup(sdk_db)
    try:
        processor.process(_records(6))  # warm: the claim is prepared, the handler's statement too
        batch = [make_record(value={"n": 100 + i}, offset=100 + i) for i in range(5)]
        with RoundTrips(store.conn) as trips:
            assert processor.process(batch).applied == 5
        assert trips.count == 2 * 5 + 1
        assert not [s for s in trips.sent if "outbox_inbox" in s], trips.sent  # no claim text sent
        assert _prepared(store) == 1
    finally:
        store.close()


def test_a_lost_prepared_claim_is_prepared_again_without_losing_or_doubling(sdk_db):
    store, processor, settled = _setup(sdk_db)
    try:
        first = _records(6)
        processor.process(first)
        for round_ in range(3):
            assert _prepared(store) == 1
            _deallocate(store)
            batch = [make_record(value={"n": 1000 * (round_ + 1) + i}, offset=i) for i in range(4)]
            with RoundTrips(store.conn) as trips:
                result = processor.process(batch)
            assert (result.applied, result.settled) == (4, 4)
            assert set(_effects(store, batch).values()) == {1}
            assert _text_claims(trips) == []  # prepared again at once, the claim retried with it
            again = processor.process(batch)  # redelivered: dropped, not applied again
            assert again.duplicates == 4 and set(_effects(store, batch).values()) == {1}
        assert settled[:6] == first
    finally:
        store.close()


def test_losses_in_a_row_turn_the_prepared_claim_off(sdk_db):
    store, processor, _ = _setup(sdk_db)
    try:
        processor.process(_records(6))
        store._prepared_losses = 2  # two losses in a row already (a pooler moving sessions)
        _deallocate(store)
        batch = [make_record(value={"n": 500 + i}, offset=i) for i in range(4)]
        with RoundTrips(store.conn) as trips:
            assert processor.process(batch).applied == 4
        assert len(_text_claims(trips)) == 4 and _prepared(store) == 0
        assert set(_effects(store, batch).values()) == {1}
    finally:
        store.close()


def test_a_failing_handler_does_not_turn_the_prepared_claim_off(sdk_db):
    """psycopg answers a rollback with DEALLOCATE ALL, which takes the prepared claim too."""
    store, processor, _ = _setup(sdk_db)
    try:
        processor.process(_records(6))
        for round_ in range(4):
            boom = make_record(value={"n": "not a number"}, offset=0)  # the handler's INSERT fails
            processor.process([boom])
            batch = [make_record(value={"n": 2000 + 10 * round_ + i}, offset=i) for i in range(3)]
            processor.process(batch[:1])
            with RoundTrips(store.conn) as trips:
                assert processor.process(batch[1:]).applied == 2
            assert _text_claims(trips) == [] and _prepared(store) == 1
    finally:
        store.close()
