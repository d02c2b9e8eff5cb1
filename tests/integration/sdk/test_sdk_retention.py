"""Inbox retention: the start-up check against the topics' retention, and the cleanup."""

from __future__ import annotations

import uuid

import psycopg
from confluent_kafka.admin import AdminClient, NewTopic
from structlog.testing import capture_logs

from consumer_sdk import InboxConsumer, cleanup_inbox
from consumer_sdk.metrics import ConsumerMetrics
from consumer_sdk.store import PgInboxStore, connect_factory
from tests.integration.sdk._support import make_config

HOUR_S = 3600


def _topic_with_retention(bootstrap: str, name: str, retention_ms: int) -> str:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1,
                                            config={"retention.ms": str(retention_ms)})])
    futures[name].result(15)
    return name


def test_start_warns_loudly_when_the_topic_outlives_the_inbox(sdk_db, broker, topic_name):
    topic = _topic_with_retention(broker.bootstrap, topic_name("ret"), retention_ms=HOUR_S * 1000)
    _topic_with_retention(broker.bootstrap, f"{topic}.dlq", retention_ms=HOUR_S * 1000)
    for inbox_retention_s, unsafe in ((60.0, 1.0), (2.0 * HOUR_S, 0.0)):
        config = make_config(sdk_db, broker, topic, inbox_retention_s=inbox_retention_s)
        consumer = InboxConsumer(config, lambda conn, message: None, metrics=ConsumerMetrics())
        with capture_logs() as logs:
            consumer.start()
            consumer.close()
        gauge = consumer.metrics.registry.get_sample_value(
            "outbox_consumer_inbox_retention_unsafe", {"consumer": config.name, "topic": topic})
        assert gauge == unsafe
        [finding] = consumer.retention
        assert finding.topic_retention_s == HOUR_S and finding.safe is (not unsafe)
        warned = [e for e in logs if e["event"] == "inbox_retention_too_short"]
        assert len(warned) == int(unsafe)
        if unsafe:
            assert warned[0]["log_level"] == "error" and warned[0]["topic_retention_s"] == HOUR_S


def _age_rows(dsn: str, consumer: str, count: int, age_s: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(count):
            conn.execute(
                "INSERT INTO outbox_inbox (consumer, event_id, topic, kafka_partition, kafka_offset, received_at) "
                "VALUES (%s, %s, 't', 0, %s, now() - make_interval(secs => %s))",
                (consumer, uuid.uuid4(), i, age_s))


def _count(dsn: str, consumer: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM outbox_inbox WHERE consumer = %s", (consumer,)).fetchone()
    return int(row[0]) if row else 0


def test_cleanup_deletes_only_this_consumers_rows_past_the_window(sdk_db):
    _age_rows(sdk_db, "mine", 7, age_s=2 * HOUR_S)
    _age_rows(sdk_db, "mine", 3, age_s=60)
    _age_rows(sdk_db, "theirs", 4, age_s=2 * HOUR_S)
    store = PgInboxStore(connect_factory(sdk_db))
    assert cleanup_inbox(store, consumer="mine", retention_s=HOUR_S, batch=2) == 7
    assert cleanup_inbox(store, consumer="mine", retention_s=HOUR_S, batch=2) == 0
    store.close()
    assert (_count(sdk_db, "mine"), _count(sdk_db, "theirs")) == (3, 4)


def test_the_consumer_loop_runs_the_cleanup(sdk_db, broker, sdk_topic):
    config = make_config(sdk_db, broker, sdk_topic, inbox_retention_s=float(HOUR_S), check_retention=False)
    _age_rows(sdk_db, config.name, 5, age_s=2 * HOUR_S)
    consumer = InboxConsumer(config, lambda conn, message: None, metrics=ConsumerMetrics())
    try:
        consumer.run_once()
    finally:
        consumer.close()
    assert _count(sdk_db, config.name) == 0
    assert consumer.metrics.registry.get_sample_value(
        "outbox_consumer_inbox_cleanup_deleted_rows_total", {"consumer": config.name}) == 5
