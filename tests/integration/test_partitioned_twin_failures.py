"""Failures and dead letters of a row whose id another row shares, on a partitioned outbox.

Its primary key is (id, created_at): a back-fill with OVERRIDING SYSTEM VALUE, or a
switchover from logical replication that left the sequence behind, gives two rows one id.
f996dbc made the marks match each row's event_id too; a failure's bookkeeping and the move
to the dead letters still went by id alone: one row's failure put its twin in back-off
and counted its attempts, and a row refused for good took its pending twin into the dead
letters (two rows of one id there: unique_violation, neither moved).  The relay's store on
that layout (Store.mark_by_event_id, as the relay sets it at start) now matches both."""

from __future__ import annotations

import os
import subprocess
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from relay import migrate
from relay.model import START, Lease, OutboxRow, ShardId
from relay.store import Store
from tests.fixtures.outbox import relay_cmd

OWNER = "twins"
NSHARDS = 16


def _twins(dsn: str, *, partitioned: bool = True) -> None:
    """Two pending rows with id 1: one back-filled into yesterday's partition, one written
    today from the identity (which starts at 1)."""
    migrate.apply(dsn, partitioned=partitioned)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox (id, topic, key, payload, created_at) OVERRIDING SYSTEM VALUE "
                     "VALUES (1, 'orders', 'old', '{}', %s)", (datetime.now(UTC) - timedelta(days=1),))
        conn.execute("INSERT INTO outbox (topic, key, payload) VALUES ('orders', 'new', '{}')")


def _claimed(store: Store) -> tuple[dict[str, OutboxRow], dict[ShardId, Any]]:
    """Every shard leased to OWNER and the claim of its rows, by key."""
    tokens = store.claim_shards(owner=OWNER, limit=NSHARDS, lease_s=60)
    rows, _, _ = store.claim(shards=sorted(tokens), nshards=NSHARDS, after=START, limit=100, sent_retries=())
    return {str(r.key): r for r in rows}, tokens


def _outbox(dsn: str) -> dict[str, dict[str, Any]]:
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        return {r["key"]: r for r in conn.execute(
            "SELECT id, event_id::text, key, attempts, retry_at, published_at FROM outbox")}


def _dead_letters(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return sorted(r[0] for r in conn.execute("SELECT event_id::text FROM outbox_dead_letters"))


def _store(dsn: str) -> Store:
    store = Store(dsn)
    store.mark_by_event_id()  # what the relay does at start on a partitioned outbox
    return store


def _lease(row: OutboxRow, tokens: dict[ShardId, Any]) -> Lease:
    return Lease(row.shard, tokens[row.shard], 0.0)


def test_a_failure_is_recorded_on_its_own_row_only(db_dsn):
    _twins(db_dsn)
    store = _store(db_dsn)
    try:
        rows, tokens = _claimed(store)
        assert rows["old"].id == rows["new"].id == 1
        failed = rows["new"]
        assert store.record_failure(owner=OWNER, lease=_lease(failed, tokens), row=failed,
                                    error="broker: boom", backoff_s=60) == 1
    finally:
        store.close()
    after = _outbox(db_dsn)
    assert after["new"]["attempts"] == 1 and after["new"]["retry_at"] is not None
    assert after["old"]["attempts"] == 0 and after["old"]["retry_at"] is None  # before: 1, in back-off


def test_a_row_refused_for_good_is_dead_lettered_and_requeued_alone(db_dsn):
    _twins(db_dsn)
    store = _store(db_dsn)
    try:
        rows, tokens = _claimed(store)
        failed, twin = rows["new"], rows["old"]
        assert store.dead_letter(owner=OWNER, lease=_lease(failed, tokens), row=failed,
                                 reason="msg_size_too_large", error="too large")
    finally:
        store.close()
    assert _dead_letters(db_dsn) == [failed.event_id]
    left = _outbox(db_dsn)
    assert list(left) == ["old"] and left["old"]["event_id"] == twin.event_id  # before: gone too
    assert left["old"]["published_at"] is None

    done = subprocess.run(relay_cmd("dead-letters", "requeue", failed.event_id), capture_output=True, text=True,
                          timeout=60, env={**os.environ, "OUTBOX_RELAY_DSN": db_dsn})
    assert done.returncode == 0, done.stderr
    assert "requeued 1 dead letter(s)" in done.stdout
    after = _outbox(db_dsn)
    assert _dead_letters(db_dsn) == []
    assert after["old"] == left["old"]  # the twin untouched
    assert after["new"]["event_id"] == failed.event_id and after["new"]["id"] != 1
    assert after["new"]["published_at"] is None and after["new"]["attempts"] == 0


def test_both_twins_refused_for_good_are_both_dead_lettered(db_dsn):
    """The dead letters were keyed by id: the second of two rows sharing one failed on it
    (unique_violation) and stayed in the outbox, retried for ever.  Migration 0016 keys them
    by event_id."""
    _twins(db_dsn)
    store = _store(db_dsn)
    try:
        rows, tokens = _claimed(store)
        for key in ("new", "old"):
            assert store.dead_letter(owner=OWNER, lease=_lease(rows[key], tokens), row=rows[key],
                                     reason="msg_size_too_large", error="too large")
    finally:
        store.close()
    assert _dead_letters(db_dsn) == sorted(r.event_id for r in rows.values())
    assert _outbox(db_dsn) == {}


@pytest.mark.parametrize("partitioned", [False, True])
def test_a_dead_letter_is_one_per_event_id(db_dsn, partitioned):
    """0016 keeps event_id unique in the dead letters (now their primary key) on both layouts."""
    migrate.apply(db_dsn, partitioned=partitioned)
    insert = ("INSERT INTO outbox_dead_letters (id, event_id, topic, headers, created_at, reason, error, attempts) "
              "VALUES (%s, '0193a0a0-0000-7000-8000-000000000001', 'orders', '{}', now(), 'r', 'e', 1)")
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(insert, (1,))
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute(insert, (2,))
