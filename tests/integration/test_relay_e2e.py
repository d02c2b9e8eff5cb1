"""The relay end to end on a real PostgreSQL and a real broker (issue 2)."""

from __future__ import annotations

import pytest

from tests.fixtures.broker import create_topic, read_all
from tests.fixtures.outbox import (
    RelayThread,
    all_event_ids,
    check_delivery,
    insert_rows,
    pending,
    scalar,
    wait_drained,
)
from tests.fixtures.procs import wait_until


def test_ten_thousand_rows_over_several_topics_and_keys_arrive_in_key_order(
        outbox_db, broker, topic_name):
    topics = [topic_name(f"orders{i}") for i in range(3)]
    for t in topics:
        create_topic(broker.bootstrap, t, partitions=3)
    sizes = [3334, 3334, 3332]
    for t, n in zip(topics, sizes, strict=True):
        insert_rows(outbox_db, t, n, keys=97, per_tx=500)
    assert pending(outbox_db) == 10_000
    expected = all_event_ids(outbox_db)

    with RelayThread(outbox_db, broker.bootstrap, batch_size=500) as relay:
        wait_drained(outbox_db, timeout_s=120)
        published = relay.metrics.registry.get_sample_value

        def total() -> float:
            return sum(published("outbox_relay_events_published_total", {"topic": t}) or 0 for t in topics)

        # The counter moves when the pump collects a mark, just after the mark's commit that
        # wait_drained saw: the last batches' counts may arrive a moment later.
        wait_until(lambda: total() >= 10_000, timeout_s=10, message=lambda: f"published counter at {total()}")
    assert total() == 10_000

    records = [r for t, n in zip(topics, sizes, strict=True) for r in read_all(broker.bootstrap, t, expected=n,
                                                                  timeout_s=60)]
    delivery = check_delivery(records, expected)
    assert delivery.missing == set()
    assert delivery.order_violations == []
    assert delivery.duplicates == 0  # a single, uninterrupted relay sends each row once
    # The murmur2 partitioner keeps each key on one partition.
    assert all(len(parts) == 1 for parts in delivery.per_key_partition.values())
    assert scalar(outbox_db, "SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0


def test_message_carries_key_payload_headers_and_event_id(outbox_db, broker, topic):
    import psycopg

    with psycopg.connect(outbox_db, autocommit=True) as conn:
        event_id = conn.execute(
            "INSERT INTO outbox (topic, key, payload, headers) VALUES "
            "(%s, 'order-1', '{\"total\": 12.5, \"items\": [1, 2]}', "
            "'{\"traceparent\": \"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\"}') "
            "RETURNING event_id", (topic,)).fetchone()[0]
        conn.execute("INSERT INTO outbox (topic, key, payload_bytes) VALUES (%s, NULL, %s)",
                     (topic, b"\x00\x01binary"))
        conn.execute("INSERT INTO outbox (topic, key) VALUES (%s, 'gone')", (topic,))
    with RelayThread(outbox_db, broker.bootstrap):
        wait_drained(outbox_db, timeout_s=30)
    records = read_all(broker.bootstrap, topic, expected=3, timeout_s=30)
    by_key = {r.key: r for r in records}
    first = by_key[b"order-1"]
    assert first.headers["event_id"].decode() == str(event_id)
    assert first.headers["traceparent"].startswith(b"00-4bf92f35")
    import json

    assert json.loads(first.value) == {"total": 12.5, "items": [1, 2]}
    assert by_key[None].value == b"\x00\x01binary"
    assert by_key[b"gone"].value is None  # neither payload column: a tombstone


@pytest.mark.parametrize(
    ("column_values", "constraint"),
    [
        ("(NULL, 'k', '{}')", "topic"),
        ("('bad topic!', 'k', '{}')", "outbox_topic_valid"),
        ("('..', 'k', '{}')", "outbox_topic_valid"),
        ("('.', 'k', '{}')", "outbox_topic_valid"),
        ("('', 'k', '{}')", "outbox_topic_valid"),
        ("('" + "x" * 250 + "', 'k', '{}')", "outbox_topic_valid"),
        ("('tópico', 'k', '{}')", "outbox_topic_valid"),
        ("('a/b', 'k', '{}')", "outbox_topic_valid"),
    ],
)
def test_schema_rejects_bad_rows_with_a_named_constraint(outbox_db, column_values, constraint):
    import psycopg

    with psycopg.connect(outbox_db, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.IntegrityError) as info:
            conn.execute(f"INSERT INTO outbox (topic, key, payload) VALUES {column_values}")  # noqa: S608
    assert constraint in str(info.value)


def test_schema_accepts_every_topic_kafka_accepts(outbox_db):
    import psycopg

    topics = ["x" * 249, "...", "a", "Orders.v2_eu-1", "_internal", "-"]
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        for topic in topics:
            conn.execute("INSERT INTO outbox (topic, key, payload) VALUES (%s, 'k', '{}')", (topic,))
        assert [r[0] for r in conn.execute("SELECT topic FROM outbox ORDER BY id")] == topics


def test_schema_rejects_headers_that_are_not_an_object_and_two_payloads(outbox_db):
    import psycopg

    with psycopg.connect(outbox_db, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.CheckViolation, match="outbox_headers_is_object"):
            conn.execute("INSERT INTO outbox (topic, payload, headers) VALUES ('t', '{}', '[1]')")
        with pytest.raises(psycopg.errors.CheckViolation, match="outbox_one_payload"):
            conn.execute("INSERT INTO outbox (topic, payload, payload_bytes) VALUES ('t', '{}', 'x')")
        with pytest.raises(psycopg.errors.InvalidTextRepresentation):
            conn.execute("INSERT INTO outbox (topic, payload) VALUES ('t', 'not json')")


def test_a_service_inserts_with_only_topic_key_and_payload(outbox_db):
    row = scalar(outbox_db, "INSERT INTO outbox (topic, key, payload) VALUES ('orders', 'o-1', "
                            "'{\"a\": 1}') RETURNING (event_id IS NOT NULL AND created_at IS NOT NULL "
                            "AND published_at IS NULL AND headers = '{}'::jsonb)")
    assert row is True


def test_migrate_is_idempotent_and_records_versions(outbox_db):
    from relay import migrate

    assert migrate.apply(outbox_db) == []
    versions = scalar(outbox_db, "SELECT array_agg(version ORDER BY version) FROM outbox_schema_migrations")
    assert versions == [m.version for m in migrate.migrations()]
    # Every file applies cleanly a second time by hand too (what other tools may do).
    import psycopg

    with psycopg.connect(outbox_db, autocommit=True) as conn:
        for m in migrate.migrations():
            conn.execute(m.sql.encode())
