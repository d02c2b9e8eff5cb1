"""Issue 19: one message at a time, a transaction's COMMIT rides with the next message's BEGIN
and claim.  A record is settled (its offset may be committed) only once the server confirmed
its COMMIT: a COMMIT that fails leaves it and every record after it unsettled, and an error
on the way out still commits (then settles) the transaction that completed before it."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest
import structlog

from consumer_sdk.errors import DatabaseUnavailable, FatalError
from consumer_sdk.metrics import ConsumerMetrics
from consumer_sdk.model import InboxMessage, KafkaRecord
from consumer_sdk.processor import Policies, Processor
from consumer_sdk.store import PgInboxStore, connect_factory
from consumer_sdk.testing import FakeDeadLetters, make_record

# A unique constraint checked at COMMIT: a second row with the same n fails the COMMIT only.
DEFERRED = """
CREATE TABLE IF NOT EXISTS deferred_effects (
    event_id uuid NOT NULL,
    n int NOT NULL UNIQUE DEFERRABLE INITIALLY DEFERRED
)
"""


class _Interrupt(BaseException):
    """Not an Exception: the processor lets it through, as a KeyboardInterrupt."""


def _setup(sdk_db: str, handler: Any) -> tuple[PgInboxStore, Processor, list[KafkaRecord], str]:
    store = PgInboxStore(connect_factory(sdk_db))
    store.conn.execute(DEFERRED)
    settled: list[KafkaRecord] = []
    name = f"dc-{uuid.uuid4().hex[:6]}"
    processor = Processor(consumer=name, store=store, handler=handler, dead_letters=FakeDeadLetters(),
                          policies=Policies(), metrics=ConsumerMetrics(), log=structlog.get_logger("tests.sdk"),
                          sleep=lambda s: None, on_settled=settled.extend, batch_size=1)
    return store, processor, settled, name


def _inbox(sdk_db: str, name: str) -> set[str]:
    with psycopg.connect(sdk_db, autocommit=True) as conn:
        rows = conn.execute("SELECT event_id::text FROM outbox_inbox WHERE consumer = %s", (name,)).fetchall()
    return {r[0] for r in rows}


def _effects(sdk_db: str) -> list[int]:
    with psycopg.connect(sdk_db, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT n FROM deferred_effects ORDER BY n").fetchall()]


def _id(record: KafkaRecord) -> str:
    return dict(record.headers)["event_id"].decode()


def insert_n(conn: Any, message: InboxMessage) -> None:
    conn.execute("INSERT INTO deferred_effects VALUES (%s, %s)", (message.event_id, message.json()["n"]))


def test_a_failing_deferred_commit_leaves_its_record_and_the_rest_unsettled(sdk_db):
    store, processor, settled, name = _setup(sdk_db, insert_n)
    records = [make_record(value={"n": n}, offset=i) for i, n in enumerate((1, 2, 1, 3))]
    try:
        with pytest.raises(FatalError):  # the third record's COMMIT violates the deferred constraint
            processor.process(records)
        assert settled == records[:2]
        assert _inbox(sdk_db, name) == {_id(r) for r in records[:2]}
        assert _effects(sdk_db) == [1, 2]
        assert not store.commit_pending
    finally:
        store.close()


def test_an_error_on_the_way_out_commits_the_completed_transaction_first(sdk_db):
    interrupted: list[int] = []

    def handler(conn: Any, message: InboxMessage) -> None:
        if message.json()["n"] == 3 and not interrupted:
            interrupted.append(3)
            raise _Interrupt()
        insert_n(conn, message)

    store, processor, settled, name = _setup(sdk_db, handler)
    records = [make_record(value={"n": n}, offset=n) for n in (1, 2, 3, 4)]
    try:
        with pytest.raises(_Interrupt):
            processor.process(records)
        assert settled == records[:2]  # the second one's COMMIT was still deferred: sent, then settled
        assert _inbox(sdk_db, name) == {_id(r) for r in records[:2]}
        assert _effects(sdk_db) == [1, 2]
        assert not store.commit_pending
        result = processor.process(records[2:])  # what was left unsettled, delivered again
        assert result.applied == 2 and _effects(sdk_db) == [1, 2, 3, 4]
    finally:
        store.close()


def test_a_redelivered_record_after_deferred_commits_settles_in_order(sdk_db):
    """Known duplicates (found by the lookup) settle after the deferred COMMIT before them."""
    store, processor, settled, _ = _setup(sdk_db, insert_n)
    first = [make_record(value={"n": n}, offset=n) for n in (1, 2)]
    try:
        processor.process(first)
        processor.process(first[:1])  # a redelivery: lookups again
        mixed = [make_record(value={"n": 10}, offset=10), first[1], make_record(value={"n": 11}, offset=11)]
        result = processor.process(mixed)
        assert (result.applied, result.duplicates) == (2, 1)
        assert settled == first + first[:1] + mixed
    finally:
        store.close()


def test_a_connection_lost_with_a_deferred_commit_fails_the_next_transaction(sdk_db):
    """Never reconnect silently over a deferred COMMIT: its callbacks would be dropped and the
    records after it settled past it (their offsets ahead of an unconfirmed commit)."""
    store = PgInboxStore(connect_factory(sdk_db))
    confirmed: list[str] = []
    message = InboxMessage(event_id=uuid.uuid4(), topic="t", partition=0, offset=0, key=None,
                           value=b"{}", headers={})
    try:
        with store.transaction(on_commit=lambda: confirmed.append("first"), defer_commit=True):
            assert store.claim(consumer="lost", message=message, payload_sha256=None) == "new"
        store.conn.close()
        with pytest.raises(DatabaseUnavailable):
            with store.transaction(on_commit=lambda: confirmed.append("second")):
                pytest.fail("a transaction began on a new connection")
        assert confirmed == [] and not store.commit_pending
        assert _inbox(sdk_db, "lost") == set()  # the deferred transaction never committed
    finally:
        store.close()


def test_sync_never_sends_the_deferred_commit_on_a_new_connection(sdk_db):
    """A COMMIT outside any transaction answers COMMIT (with a warning): sent on a new
    connection it would confirm a transaction that was lost with the old one."""
    store = PgInboxStore(connect_factory(sdk_db))
    confirmed: list[str] = []
    message = InboxMessage(event_id=uuid.uuid4(), topic="t", partition=0, offset=0, key=None,
                           value=b"{}", headers={})
    try:
        with store.transaction(on_commit=lambda: confirmed.append("first"), defer_commit=True):
            store.claim(consumer="lost-sync", message=message, payload_sha256=None)
        store.conn.close()
        with pytest.raises(DatabaseUnavailable):
            store.sync()
        assert confirmed == [] and not store.commit_pending
        assert _inbox(sdk_db, "lost-sync") == set()
    finally:
        store.close()
