"""Partitions added to a topic the relay publishes to, on Apache Kafka: the relay says so
(``topic_partitions_changed`` 2 -> 4, ``outbox_relay_topic_partition_changes_total``) and
loses nothing.

Kafka's default partitioner maps a key to ``murmur2(key) % partitions``: the added partitions
move keys, and per-key order holds only within each partition from then on.  Kafka warns
nobody; the relay is the process that sees it first (relay/topic_partitions.py).  Its watch
looks every 0.2 s here (60 s in production)."""

from __future__ import annotations

import json
import threading
from typing import Any

from confluent_kafka.admin import NewPartitions  # type: ignore[attr-defined]

from relay.app import Relay
from tests.fixtures.apache_kafka import ApacheKafkaBroker, admin_client
from tests.fixtures.broker import create_topic, read_all
from tests.fixtures.outbox import (
    RecordingLog,
    all_event_ids,
    check_delivery,
    insert_rows,
    migrated,
    settings,
    wait_drained,
)
from tests.fixtures.procs import wait_until

ROWS = 300  # each time: before the partitions are added, after, and after it was said


def test_partitions_added_to_a_topic_are_said_and_counted_and_nothing_is_lost(
        db_dsn: str, kafka_broker: ApacheKafkaBroker, topic_name: Any) -> None:
    dsn, bootstrap = migrated(db_dsn), kafka_broker.bootstrap
    topic = topic_name("orders")
    create_topic(bootstrap, topic, partitions=2)
    log = RecordingLog("partitions-added")
    relay = Relay(settings(dsn, bootstrap, owner="partitions-added"), log=log, partitions_check_s=0.2)
    thread = threading.Thread(target=relay.run, daemon=True, name="relay-partitions-added")
    thread.start()
    try:
        insert_rows(dsn, topic, ROWS, keys=30)
        # The watch has seen the topic's first count (no change: nothing said).
        wait_until(lambda: relay.partition_watch is not None and relay.partition_watch.counts.seen.get(topic) == 2,
                   timeout_s=30, message=lambda: f"counts seen: {relay.partition_watch and relay.partition_watch.counts.seen}")
        assert log.named("topic_partitions_changed") == []
        admin = admin_client(bootstrap)
        admin.create_partitions([NewPartitions(topic, 4)])[topic].result(timeout=30)
        # The broker's metadata says so before the rows below are published and looked up.
        wait_until(lambda: len(admin.list_topics(topic, timeout=5).topics[topic].partitions) == 4,
                   timeout_s=30, message="the broker's metadata does not show 4 partitions")
        insert_rows(dsn, topic, ROWS, keys=30, start=ROWS)
        wait_until(lambda: log.named("topic_partitions_changed"), timeout_s=30,
                   message=lambda: f"not said; counts seen: {relay.partition_watch and relay.partition_watch.counts.seen}")
        wait_drained(dsn, timeout_s=30)
        # Written once it was said: the relay's producer learnt the count from the watch's
        # request (not at its own refresh, 5 minutes apart), so keys move from now on.
        insert_rows(dsn, topic, ROWS, keys=30, start=2 * ROWS)
        wait_drained(dsn, timeout_s=30)
    finally:
        relay.stop()
        thread.join(30)
    assert not thread.is_alive(), "relay did not stop"

    (said,) = log.named("topic_partitions_changed")
    assert (said["topic"], said["partitions_before"], said["partitions_after"]) == (topic, 2, 4)
    assert "per-key order holds only within each partition" in said["hint"]
    assert relay.metrics.registry.get_sample_value(
        "outbox_relay_topic_partition_changes_total", {"topic": topic}) == 1
    expected = all_event_ids(dsn)
    assert len(expected) == 3 * ROWS
    records = read_all(bootstrap, topic, expected=expected, timeout_s=30)
    delivery = check_delivery(records, expected)
    assert not delivery.missing and len(delivery.unique) == 3 * ROWS
    later = {r.partition for r in records if json.loads(r.value or b"{}")["g"] >= 2 * ROWS}
    assert later & {2, 3}, f"rows written after the change went to partitions {sorted(later)} only"
