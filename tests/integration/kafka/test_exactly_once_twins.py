"""Exactly-once recovery on a partitioned outbox whose ids repeat (Apache Kafka).

A partitioned outbox keeps (id, created_at) unique, not id: a back-fill with OVERRIDING
SYSTEM VALUE, or a logical-replication switchover that left the sequence behind, gives two
rows one id.  A replica that takes a shard marks the rows its last position record lists.
The record's event digests picked the listed row out of the two, but the mark itself went
by id: it marked the pending twin too, which was never sent.  It now goes by (id, event_id)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import psycopg

from relay import migrate
from tests.fixtures.broker import create_topic, read_all
from tests.fixtures.outbox import (
    RelayThread,
    all_event_ids,
    check_delivery,
    insert_rows,
    scalar,
    wait_drained,
)
from tests.integration.kafka.test_exactly_once_e2e import _eo, _positions


def test_recovery_marks_the_listed_rows_not_their_twins(db_dsn, kafka_broker, topic_name):
    migrate.apply(db_dsn, partitioned=True)
    topic = topic_name("eo-twins")
    create_topic(kafka_broker.bootstrap, topic, partitions=3)
    insert_rows(db_dsn, topic, 2000, keys=20)
    eo = _eo(topic_name)
    with RelayThread(db_dsn, kafka_broker.bootstrap, **eo):
        wait_drained(db_dsn, timeout_s=60)
    positions = _positions(kafka_broker.bootstrap, eo["exactly_once_position_topic"], 16)
    listed = sorted({int(i) for p in positions.values() for i in p["ids"]})  # type: ignore[union-attr]
    assert listed
    sent_before = all_event_ids(db_dsn)

    # A crash between the last commits and their marks: the listed rows pending again.  And
    # a back-fill into yesterday's partition, with ids the records list: the twins.
    scalar(db_dsn, "WITH u AS (UPDATE outbox SET published_at = NULL WHERE id = ANY(%(ids)s) "
                   "RETURNING 1) SELECT count(*) FROM u", {"ids": listed})
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox (id, topic, key, payload, created_at) OVERRIDING SYSTEM VALUE "
                     "SELECT i, %s, 'twin-' || i, jsonb_build_object('key', 'twin-' || i, 'seq', 0), %s "
                     "FROM unnest(%s::bigint[]) AS i", (topic, datetime.now(UTC) - timedelta(days=1), listed))
    twins = all_event_ids(db_dsn) - sent_before
    assert len(twins) == len(listed)
    assert int(scalar(db_dsn, "SELECT count(*) FROM outbox WHERE published_at IS NULL")) == 2 * len(listed)

    with RelayThread(db_dsn, kafka_broker.bootstrap, **eo):
        wait_drained(db_dsn, timeout_s=60)
    expected = sent_before | twins
    records = read_all(kafka_broker.bootstrap, topic, expected=expected, timeout_s=30, extra_wait_s=2)
    delivery = check_delivery(records, expected)
    lost = delivery.missing & twins
    assert lost == set(), f"{len(lost)} of {len(twins)} twins marked published by the recovery, never sent"
    assert delivery.missing == set()
    assert delivery.duplicates == 0  # the listed rows were recovered, not sent again
