"""Exactly-once mode (issue 20) in process, on Apache Kafka: every row once to a
read_committed consumer, the position topic, recovery after a lost mark."""

from __future__ import annotations

import json

from confluent_kafka import Consumer, TopicPartition

from tests.fixtures.broker import create_topic, read_all
from tests.fixtures.outbox import (
    RelayThread,
    all_event_ids,
    check_delivery,
    insert_rows,
    migrated,
    scalar,
    wait_drained,
)


def _eo(topic_name, label: str = "pos") -> dict[str, str]:
    return {"exactly_once": "true",
            "exactly_once_position_topic": topic_name(label),
            "exactly_once_transactional_id_prefix": topic_name("txn") + "."}


def _positions(bootstrap: str, topic: str, shards: int) -> dict[int, dict[str, object]]:
    """The last committed position record of every shard."""
    records = read_all(bootstrap, topic, expected=10**9, timeout_s=5)
    last: dict[int, dict[str, object]] = {}
    for rec in records:
        last[rec.partition] = json.loads(rec.value or b"{}")
    assert set(last) <= set(range(shards))
    return last


def test_exactly_once_drains_every_row_once(db_dsn, kafka_broker, topic_name):
    dsn = migrated(db_dsn)
    topic = topic_name("eo")
    create_topic(kafka_broker.bootstrap, topic, partitions=3)
    insert_rows(dsn, topic, 5000, keys=50, per_tx=500)
    expected = all_event_ids(dsn)
    eo = _eo(topic_name)
    with RelayThread(dsn, kafka_broker.bootstrap, batch_size=200, **eo) as relay:
        wait_drained(dsn, timeout_s=90)
        committed = relay.metrics.transactions.labels("committed")._value.get()
    assert committed > 0
    records = read_all(kafka_broker.bootstrap, topic, expected=expected, timeout_s=30,
                       extra_wait_s=1)
    delivery = check_delivery(records, expected)
    assert delivery.missing == set()
    assert delivery.duplicates == 0
    assert delivery.order_violations == []
    positions = _positions(kafka_broker.bootstrap, eo["exactly_once_position_topic"], 16)
    assert positions, "no position record committed"
    assert all("token" in p and "ids" in p for p in positions.values())
    # The position topic is compacted and has one partition per shard.
    consumer = Consumer({"bootstrap.servers": kafka_broker.bootstrap, "group.id": "eo-meta"})
    try:
        meta = consumer.list_topics(eo["exactly_once_position_topic"], timeout=10)
        assert len(meta.topics[eo["exactly_once_position_topic"]].partitions) == 16
        low, high = consumer.get_watermark_offsets(
            TopicPartition(eo["exactly_once_position_topic"], 0), timeout=10)
        assert high >= low
    finally:
        consumer.close()


def test_rows_committed_but_not_marked_are_recovered_not_republished(db_dsn, kafka_broker,
                                                                     topic_name):
    """A crash between the commit and the mark: the next holder reads the position
    record back and marks its rows; nothing is produced twice."""
    dsn = migrated(db_dsn)
    topic = topic_name("eo-recover")
    create_topic(kafka_broker.bootstrap, topic, partitions=3)
    insert_rows(dsn, topic, 2000, keys=20)
    expected = all_event_ids(dsn)
    eo = _eo(topic_name)
    with RelayThread(dsn, kafka_broker.bootstrap, **eo):
        wait_drained(dsn, timeout_s=60)
    # Forget the marks of the rows the last transactions listed, as if the relay had died
    # between the commit and the mark.
    positions = _positions(kafka_broker.bootstrap, eo["exactly_once_position_topic"], 16)
    listed = sorted({int(i) for p in positions.values() for i in p["ids"]})  # type: ignore[union-attr]
    assert listed
    scalar(dsn, "WITH u AS (UPDATE outbox SET published_at = NULL WHERE id = ANY(%(ids)s) "
                "RETURNING 1) SELECT count(*) FROM u", {"ids": listed})
    assert int(scalar(dsn, "SELECT count(*) FROM outbox WHERE published_at IS NULL")) == len(listed)
    with RelayThread(dsn, kafka_broker.bootstrap, **eo):
        wait_drained(dsn, timeout_s=60)
    records = read_all(kafka_broker.bootstrap, topic, expected=expected, timeout_s=30,
                       extra_wait_s=2)
    delivery = check_delivery(records, expected)
    assert delivery.missing == set()
    assert delivery.duplicates == 0
    assert delivery.order_violations == []
