"""Exactly-once mode with a position topic whose ``max.message.bytes`` is small (Apache Kafka).

A shard's position record lists the rows of its transaction and its earlier committed rows
not confirmed marked: 1,000 rows took about 25 kB.  Over the topic's limit the broker refused
it, the transaction aborted and its rows were retried into the same record for ever: the
shard stalled, nothing of it published.  The relay now reads the topic's limit at start and
writes a position too large for one record in parts that fit, which recovery reads back
whole; a limit lowered while it runs is met by cutting the next records to half."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from relay.exactly_once_shard import (
    Job,
    Result,
    ShardWorker,
    ensure_position_topic,
    event_digest,
    read_position,
)
from relay.model import OutboxRow, RowId, ShardId, Token
from tests.fixtures.apache_kafka import admin_client
from tests.fixtures.broker import create_topic, read_all
from tests.fixtures.outbox import (
    RelayThread,
    all_event_ids,
    check_delivery,
    insert_rows,
    migrated,
    wait_drained,
)
from tests.fixtures.procs import wait_until

SMALL_BYTES = 20_000  # the position topic's max.message.bytes: under one record of 1,000 rows
SHARDS = 16  # the relay's default


def _position_topic(bootstrap: str, name: str, max_bytes: int | None = SMALL_BYTES) -> None:
    config = {"cleanup.policy": "compact"}
    if max_bytes is not None:
        config["max.message.bytes"] = str(max_bytes)
    admin = admin_client(bootstrap)  # kept until the answer: a client freed cancels its requests
    admin.create_topics([NewTopic(name, num_partitions=SHARDS, replication_factor=1,
                                  config=config)])[name].result(timeout=30)


def _lower_limit(bootstrap: str, name: str) -> None:
    admin = admin_client(bootstrap)
    resource = ConfigResource(ResourceType.TOPIC, name, incremental_configs=[ConfigEntry(
        "max.message.bytes", str(SMALL_BYTES), incremental_operation=AlterConfigOpType.SET)])
    admin.incremental_alter_configs([resource])[resource].result(timeout=30)

    def lowered() -> bool:
        described = admin.describe_configs([ConfigResource(ResourceType.TOPIC, name)])
        return next(iter(described.values())).result(timeout=10)["max.message.bytes"].value == str(SMALL_BYTES)
    wait_until(lowered, timeout_s=30, message="the topic's max.message.bytes not lowered")


def _drain(dsn: str, bootstrap: str, topic: str, rows: int, start: int = 0) -> None:
    """``rows`` rows of one key (one shard: its transactions of 1,000 rows) published once."""
    insert_rows(dsn, topic, rows, keys=1, start=start, per_tx=1_000)
    wait_drained(dsn, timeout_s=45)
    expected = all_event_ids(dsn)
    delivery = check_delivery(read_all(bootstrap, topic, expected=expected, timeout_s=30), expected)
    assert delivery.missing == set() and delivery.duplicates == 0 and delivery.order_violations == []


def test_a_small_position_topic_limit_is_read_at_start_and_nothing_stalls(db_dsn, kafka_broker, topic_name):
    dsn, topic, position_topic = migrated(db_dsn), topic_name("eo"), topic_name("pos")
    create_topic(kafka_broker.bootstrap, topic, partitions=3)
    _position_topic(kafka_broker.bootstrap, position_topic)
    eo = {"exactly_once": "true", "exactly_once_position_topic": position_topic,
          "exactly_once_transactional_id_prefix": topic_name("txn") + "."}
    with RelayThread(dsn, kafka_broker.bootstrap, **eo) as relay:
        _drain(dsn, kafka_broker.bootstrap, topic, 3_000)
        transactions = relay.metrics.transactions
        assert transactions.labels("committed")._value.get() > 0
        assert transactions.labels("aborted")._value.get() == 0  # the limit was known: none refused
        assert relay.relay.exactly_once.record_limit_bytes == SMALL_BYTES  # read at start, handed over


def test_a_limit_lowered_while_the_relay_runs_cuts_the_next_records(db_dsn, kafka_broker, topic_name):
    dsn, topic, position_topic = migrated(db_dsn), topic_name("eo"), topic_name("pos")
    create_topic(kafka_broker.bootstrap, topic, partitions=3)
    _position_topic(kafka_broker.bootstrap, position_topic, max_bytes=None)  # the broker's 1 MB
    eo = {"exactly_once": "true", "exactly_once_position_topic": position_topic,
          "exactly_once_transactional_id_prefix": topic_name("txn") + "."}
    with RelayThread(dsn, kafka_broker.bootstrap, **eo) as relay:
        insert_rows(dsn, topic, 10, keys=1)
        wait_drained(dsn, timeout_s=45)  # its shard's producer is up
        _lower_limit(kafka_broker.bootstrap, position_topic)
        _drain(dsn, kafka_broker.bootstrap, topic, 3_000, start=10)
        assert relay.metrics.transactions.labels("aborted")._value.get() >= 1  # refused, then cut


def _row(topic: str, i: int) -> OutboxRow:
    return OutboxRow(RowId(i), f"00000000-0000-7000-8000-{i:012d}", topic, "k", b"v", "{}", 1, ShardId(0), 0, 0.0)


def test_a_position_written_in_parts_is_read_back_whole(kafka_broker: Any, topic_name: Callable[[str], str]) -> None:
    """What a new holder recovers from: every row the parts list, in order, and no other."""
    topic, position_topic = topic_name("eo-parts"), topic_name("pos")
    config = {"bootstrap.servers": kafka_broker.bootstrap}
    create_topic(kafka_broker.bootstrap, topic, partitions=1)
    _position_topic(kafka_broker.bootstrap, position_topic)
    limit = ensure_position_topic(config, position_topic, SHARDS).record_limit_bytes
    assert limit == SMALL_BYTES
    results: queue.SimpleQueue[Result] = queue.SimpleQueue()
    worker = ShardWorker(ShardId(0), Token(1), config=config, transactional_id=topic_name("txn"),
                         position_topic=position_topic, outbox="o", results=results,
                         recover=lambda *_: None)
    try:
        assert results.get(timeout=60).ok
        rows = [_row(topic, i) for i in range(1, 4)]
        own = [(row.id, event_digest(row.event_id)) for row in rows]
        earlier = [(RowId(i), event_digest(f"e{i}")) for i in range(10**15, 10**15 + 3_000)]
        # Committed rows not confirmed marked yet, from earlier transactions, and this one's:
        # in parts (at the topic's limit; then in more parts than the reader's first look
        # back, POSITION_TAIL); then this one's alone, in one record again (no part read).
        for listed, limit_bytes in ((earlier + own, limit), (earlier + own, 1_500), (own, limit)):
            worker.submit(Job(rows=[(row, []) for row in rows], position=listed,
                              callbacks={row.id: None for row in rows}, limit_bytes=limit_bytes))
            result = results.get(timeout=60)
            assert result.ok, result.error
            position = read_position(config, position_topic, ShardId(0))
            assert list(zip(position.ids, position.events or [], strict=True)) == listed
    finally:
        worker.close()
        worker.join(30)
