"""Exactly-once mode (issue 20) in process, on Apache Kafka: every row once to a
read_committed consumer, the position topic, recovery after a lost mark."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
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


@contextlib.contextmanager
def two_outboxes(db_dsn: str, pg_server: Any) -> Iterator[tuple[str, str]]:
    """Two migrated outbox databases (every outbox table is "outbox"); the second is dropped after."""
    name = f"t_eo_second_outbox_{uuid.uuid4().hex[:8]}"
    first, second = migrated(db_dsn), migrated(pg_server.create_database(name))
    try:
        yield first, second
    finally:
        pg_server.drop_database(name)


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


def _drained_and_listed(db_dsn: str, kafka_broker: Any, topic_name: Any,
                        label: str) -> tuple[str, str, dict[str, str], list[int]]:
    """2,000 rows drained in exactly-once mode: (the DSN, the topic, the mode's settings, the
    row ids the shards' last position records list)."""
    dsn = migrated(db_dsn)
    topic = topic_name(label)
    create_topic(kafka_broker.bootstrap, topic, partitions=3)
    insert_rows(dsn, topic, 2000, keys=20)
    eo = _eo(topic_name)
    with RelayThread(dsn, kafka_broker.bootstrap, **eo):
        wait_drained(dsn, timeout_s=60)
    positions = _positions(kafka_broker.bootstrap, eo["exactly_once_position_topic"], 16)
    listed = sorted({int(i) for p in positions.values() for i in p["ids"]})  # type: ignore[union-attr]
    assert listed
    return dsn, topic, eo, listed


def test_rows_committed_but_not_marked_are_recovered_not_republished(db_dsn, kafka_broker,
                                                                     topic_name):
    """A crash between the commit and the mark: the next holder reads the position
    record back and marks its rows; nothing is produced twice."""
    dsn, topic, eo, listed = _drained_and_listed(db_dsn, kafka_broker, topic_name, "eo-recover")
    expected = all_event_ids(dsn)
    # Forget the marks of the rows the last transactions listed, as if the relay had died
    # between the commit and the mark.
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


def test_ids_handed_out_again_after_a_restore_are_sent_not_taken_for_the_listed_rows(
        db_dsn, kafka_broker, topic_name):
    """A database restored from a backup hands out again the ids published since the
    backup, to new events.  The position records listed bare ids, and the next holder
    marked those new rows published by their ids without ever sending them (an audit of
    exactly-once mode: 294 and 454 of 500 new rows lost).  The records list the event ids
    too, and only rows that still hold them are marked."""
    dsn, topic, eo, listed = _drained_and_listed(db_dsn, kafka_broker, topic_name, "eo-restore")
    # As after a restore: the listed ids now name new, pending events.
    scalar(dsn, "WITH u AS (UPDATE outbox SET published_at = NULL, event_id = gen_random_uuid() "
                "WHERE id = ANY(%(ids)s) RETURNING 1) SELECT count(*) FROM u", {"ids": listed})
    with psycopg.connect(dsn, autocommit=True) as conn:
        reborn = {str(r[0]) for r in conn.execute("SELECT event_id FROM outbox WHERE published_at IS NULL")}
    assert len(reborn) == len(listed)
    with RelayThread(dsn, kafka_broker.bootstrap, **eo):
        wait_drained(dsn, timeout_s=60)
    records = read_all(kafka_broker.bootstrap, topic, expected=reborn, timeout_s=30, extra_wait_s=2)
    delivery = check_delivery(records, reborn)
    assert delivery.missing == set(), f"{len(delivery.missing)} of {len(reborn)} new events never sent"
    assert delivery.duplicates == 0


def test_a_relay_refuses_another_outboxs_position_records(db_dsn, pg_server, kafka_broker, topic_name):
    """Two outboxes whose relays share the position topic and the transactional id prefix
    (both defaults, and every outbox table is "outbox").  Before migration 0013, the second
    relay read the first one's position records when it took its shards and marked those
    row ids published in its own database: rows marked that were never sent.  Now each
    record names its outbox, and the second relay stops with a ConfigError (exit code 2)
    before it marks anything."""
    with two_outboxes(db_dsn, pg_server) as (first, second):
        topic = topic_name("eo-two")
        create_topic(kafka_broker.bootstrap, topic, partitions=3)
        eo = _eo(topic_name)
        insert_rows(first, topic, 2000, keys=20)
        with RelayThread(first, kafka_broker.bootstrap, **eo):
            wait_drained(first, timeout_s=60)
        positions = _positions(kafka_broker.bootstrap, eo["exactly_once_position_topic"], 16)
        assert positions and all(p.get("outbox") for p in positions.values())
        insert_rows(second, topic, 2000, keys=20)  # ids 1..2000 again, in another database
        relay = RelayThread(second, kafka_broker.bootstrap, **eo).start()
        relay._thread.join(30)  # noqa: SLF001 - it stops on its own
        stopped = not relay._thread.is_alive()  # noqa: SLF001
        # Nothing of the second outbox is marked unless the broker has it.
        with psycopg.connect(second, autocommit=True) as conn:
            marked = {r[0] for r in conn.execute("SELECT event_id::text FROM outbox "
                                                 "WHERE published_at IS NOT NULL")}
        sent = {r.headers["event_id"].decode()
                for r in read_all(kafka_broker.bootstrap, topic, expected=10**9, timeout_s=5)}
        if not stopped:
            relay.relay.stop()
            relay._thread.join(30)  # noqa: SLF001
        assert marked <= sent, (len(marked - sent), "rows marked published that were never sent")
        assert stopped, "the second relay did not stop"
        assert relay.error is not None and getattr(relay.error, "exit_code", None) == 2, relay.error
        assert "written by another outbox" in str(relay.error)
        assert eo["exactly_once_position_topic"] in str(relay.error)


def test_a_second_outbox_on_the_same_defaults_stops_without_fencing_the_first(
        db_dsn, pg_server, kafka_broker, topic_name):
    """Two services, each with its outbox and a relay in exactly-once mode with the default
    position topic and transactional ids, on one Kafka.  The second relay took each shard's
    transactional id before reading the shard's position record: it fenced the running first
    relay's producers (its transactions failed, it lost its leases and took them back,
    fencing in turn) before it found the first outbox's records and stopped.  Now it reads
    the record first and stops without fencing anything: the first relay goes on."""
    with two_outboxes(db_dsn, pg_server) as (first, second):
        topic = topic_name("eo-fence")
        create_topic(kafka_broker.bootstrap, topic, partitions=3)
        eo = _eo(topic_name)
        insert_rows(first, topic, 2000, keys=400)  # rows in every one of the 16 shards
        with RelayThread(first, kafka_broker.bootstrap, **eo) as running:
            wait_drained(first, timeout_s=60)
            positions = _positions(kafka_broker.bootstrap, eo["exactly_once_position_topic"], 16)
            assert len(positions) == 16
            metrics = running.relay.metrics
            insert_rows(second, topic, 500, keys=20)
            newcomer = RelayThread(second, kafka_broker.bootstrap, **eo).start()
            newcomer._thread.join(30)  # noqa: SLF001 - it stops on its own
            assert not newcomer._thread.is_alive(), "the second relay did not stop"  # noqa: SLF001
            assert getattr(newcomer.error, "exit_code", None) == 2, newcomer.error
            assert "written by another outbox" in str(newcomer.error)
            insert_rows(first, topic, 2000, keys=400)  # the first relay goes on
            wait_drained(first, timeout_s=60)
            assert metrics.transactions.labels("fenced")._value.get() == 0
            assert metrics.transactions.labels("aborted")._value.get() == 0
            assert metrics.leases_lost._value.get() == 0
            assert running._thread.is_alive()  # noqa: SLF001
        expected = all_event_ids(first)
        records = read_all(kafka_broker.bootstrap, topic, expected=expected, timeout_s=30,
                           extra_wait_s=1)
        delivery = check_delivery(records, expected)
        assert delivery.missing == set() and delivery.duplicates == 0


def test_exactly_once_mode_asks_for_migration_0013(db_dsn):
    """Without the outbox's identity the position records could not name their writer: the
    relay says which migration it needs and exits with code 2, before it touches Kafka."""
    dsn = migrated(db_dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE outbox_relay_settings DROP COLUMN outbox_id")
    relay = RelayThread(dsn, "127.0.0.1:1", exactly_once="true").start()
    relay._thread.join(30)  # noqa: SLF001 - it stops on its own
    assert not relay._thread.is_alive(), "the relay did not stop"  # noqa: SLF001
    assert relay.error is not None and getattr(relay.error, "exit_code", None) == 2, relay.error
    assert "needs migration 0013" in str(relay.error) and "outbox-relay migrate" in str(relay.error)


def test_the_position_read_finds_the_last_committed_record(kafka_broker, topic_name):
    """read_position returns the last committed record of a shard's partition, past a
    later aborted transaction longer than the tail it reads first, and nothing for a
    partition without records; read one message at a time since the read ends at the
    partition's end instead of a batch's timeout."""
    from confluent_kafka import Producer

    from relay.exactly_once_shard import (
        POSITION_TAIL,
        PositionReader,
        ensure_position_topic,
        read_position,
    )
    from relay.model import ShardId

    config = {"bootstrap.servers": kafka_broker.bootstrap}
    topic = topic_name("pos")
    ensure_position_topic(config, topic, 2)
    producer = Producer({**config, "transactional.id": topic_name("txn")})
    producer.init_transactions(30)

    def write(ids: list[int], *, commit: bool, outbox: str | None = "o-1/outbox") -> None:
        producer.begin_transaction()
        for i in ids:
            record = {"token": 1, "ids": [i], **({"outbox": outbox} if outbox else {})}
            producer.produce(topic, json.dumps(record).encode(), key=b"0", partition=0)
        (producer.commit_transaction if commit else producer.abort_transaction)(30)

    def last(shard: int) -> tuple[list[int], str | None]:
        position = read_position(config, topic, ShardId(shard))
        return position.ids, position.writer

    write(list(range(10)), commit=True, outbox=None)  # records from before migration 0013
    assert last(0) == ([9], None)
    write([10, 11], commit=True)
    write(list(range(100, 100 + 2 * POSITION_TAIL)), commit=False)  # aborted, past the tail
    assert last(0) == ([11], "o-1/outbox")
    assert last(1) == ([], None)
    # A transaction open on the partition (a previous holder's, or another outbox's): the read
    # ends at the last stable offset, before it, instead of waiting for it (a 5 s timeout
    # here would raise); once it commits, the partition's end has moved.
    reader = PositionReader(config, topic, ShardId(0), timeout_s=5)
    try:
        producer.begin_transaction()
        producer.produce(topic, json.dumps({"token": 2, "ids": [12], "outbox": "o-1/outbox"}).encode(),
                         key=b"0", partition=0)
        producer.flush(10)  # the record is in the log, its transaction open
        before = reader.read()
        assert (before.ids, before.writer) == ([11], "o-1/outbox")
        assert reader.end() == before.end
        producer.commit_transaction(30)
        assert reader.end() != before.end
        assert reader.read().ids == [12]
    finally:
        reader.close()
    producer.flush(10)


def test_a_record_no_relay_wrote_stops_the_relay_with_where_it_is(db_dsn, kafka_broker, topic_name):
    """Something else wrote to the position topic: its record was read as JSONDecodeError or
    KeyError: 'ids', retried for ever, the shard held and its rows pending, the log naming
    no record (an audit of exactly-once mode).  Now the relay stops, as for another
    outbox's record, with the topic, the partition and the offset; nothing is marked."""
    from confluent_kafka import Producer

    from relay.exactly_once_shard import ForeignPosition, ensure_position_topic, read_position
    from relay.model import ShardId

    config = {"bootstrap.servers": kafka_broker.bootstrap}
    eo = _eo(topic_name)
    position_topic = eo["exactly_once_position_topic"]
    ensure_position_topic(config, position_topic, 16)
    producer = Producer(config)
    for partition, value in ((3, b"not json"), (4, b'{"token": 1}'), (5, b'{"ids": [1, 2], "events": [7]}'),
                             (6, None)):
        producer.produce(position_topic, value, key=str(partition).encode(), partition=partition)
    assert producer.flush(30) == 0
    for partition in (3, 4, 5):
        with pytest.raises(ForeignPosition, match=rf"{position_topic}\[{partition}\]@0 is not a position record"):
            read_position(config, position_topic, ShardId(partition))
    assert read_position(config, position_topic, ShardId(6)).ids == []  # a tombstone lists nothing
    dsn = migrated(db_dsn)
    topic = topic_name("eo-garbage")
    create_topic(kafka_broker.bootstrap, topic, partitions=3)
    insert_rows(dsn, topic, 200, keys=20)
    relay = RelayThread(dsn, kafka_broker.bootstrap, **eo).start()
    relay._thread.join(60)  # noqa: SLF001 - it stops on its own
    stopped = not relay._thread.is_alive()  # noqa: SLF001
    if not stopped:
        relay.relay.stop()
        relay._thread.join(30)  # noqa: SLF001
    assert stopped, "the relay did not stop"
    assert relay.error is not None and getattr(relay.error, "exit_code", None) == 2, relay.error
    assert "is not a position record a relay wrote" in str(relay.error)


def test_a_position_topic_deleted_under_a_running_relay_is_created_again(db_dsn, kafka_broker, topic_name):
    """Deleted while the relay ran, the position topic was never created again: every
    shard's set-up failed for ever, the log blaming the event topics' partitions (an audit
    of exactly-once mode); only a restart made it again."""
    from tests.fixtures.apache_kafka import admin_client

    dsn = migrated(db_dsn)
    topic = topic_name("eo-deleted")
    create_topic(kafka_broker.bootstrap, topic, partitions=3)
    eo = _eo(topic_name)
    insert_rows(dsn, topic, 500, keys=20)
    admin = admin_client(kafka_broker.bootstrap)
    with RelayThread(dsn, kafka_broker.bootstrap, **eo):
        wait_drained(dsn, timeout_s=60)
        admin.delete_topics([eo["exactly_once_position_topic"]], operation_timeout=30)[
            eo["exactly_once_position_topic"]].result(timeout=30)
        insert_rows(dsn, topic, 500, keys=20, start=500)
        wait_drained(dsn, timeout_s=90)  # the same relay: the topic is back
    meta = admin.list_topics(eo["exactly_once_position_topic"], timeout=10).topics[eo["exactly_once_position_topic"]]
    assert meta.error is None and len(meta.partitions) == 16
    expected = all_event_ids(dsn)
    delivery = check_delivery(read_all(kafka_broker.bootstrap, topic, expected=expected, timeout_s=30,
                                       extra_wait_s=1), expected)
    assert delivery.missing == set()
