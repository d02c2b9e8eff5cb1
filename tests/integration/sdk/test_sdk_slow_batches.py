"""A poll's messages applied for longer than ``max.poll.interval.ms`` (slow handlers), on a real broker.

librdkafka leaves the group when the application has not polled for
``max.poll.interval.ms``.  One at a time, a poll's ``prefetch_records`` (500) messages, each
in its own transaction, take that long at 0.6 s a message (the default interval is 5 min).
Before, nothing polled between those transactions: the member left the group halfway, its
offsets could not be committed ("Commit failed: Broker: Unknown member"), its partitions
were lost and assigned again (to another member, which applied the same partitions' next
events while this one still applied its own), and the whole poll came again as duplicates.
The consumer now polls between two transactions once half the interval went by (a
statements handler's chain of transactions ends there; one transaction that long:
test_sdk_long_transactions.py).  Apache
Kafka only: tansu takes the commit of a member that left, so the test could not see it leave.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from structlog.testing import capture_logs

from tests.integration.sdk._support import (
    FAST_GROUP,
    effect_counts,
    make_config,
    numbered_events_on_kafka,
    record_effect,
    wait_for,
)

#: librdkafka wants max.poll.interval.ms >= session.timeout.ms, and the broker a session of 6 s at least.
MAX_POLL_INTERVAL_MS = 6000
HANDLER_S = 0.15  # a handler's statement: 60 of them, 9 s, are one and a half poll intervals
COUNT = 60


@pytest.mark.parametrize("way", ["handler", "statements"])
def test_a_poll_slower_than_max_poll_interval_keeps_the_member_and_its_offsets(
        sdk_db: str, kafka_broker: Any, topic_name: Any, run_consumer: Any, way: str) -> None:
    broker = kafka_broker  # tansu does not check a commit's member: there the member left unseen
    topic = topic_name("slow")
    ids = numbered_events_on_kafka(broker.bootstrap, topic, COUNT)

    def slow(conn: psycopg.Connection[Any], message: Any) -> None:
        conn.execute("SELECT pg_sleep(%s)", (HANDLER_S,))
        record_effect(conn, message)

    def statements(message: Any) -> list[tuple[str, Any]]:  # chained: one poll's in one pipeline
        return [("SELECT pg_sleep(%s)", (HANDLER_S,)),
                ("INSERT INTO effects (event_id, consumer, n) VALUES (%s, 'c', %s)",
                 (message.event_id, message.json()["n"]))]

    props = {**FAST_GROUP, "max.poll.interval.ms": MAX_POLL_INTERVAL_MS}
    config = make_config(sdk_db, broker, topic, assignment="subscribe", kafka_properties=props,
                         prefetch_records=COUNT, check_retention=False)
    with capture_logs() as logs:
        thread = run_consumer(config, slow) if way == "handler" else \
            run_consumer(config, None, statements=statements)
        wait_for(lambda: thread.consumer.offsets.committed.get((topic, 0)) == COUNT or thread.error is not None,
                 timeout_s=90, message=lambda: f"committed {thread.consumer.offsets.committed}, "
                                               f"applied {len(effect_counts(sdk_db))} of {COUNT}")
        running = list(logs)  # not the revoke of the close
        thread.stop()
    effects = effect_counts(sdk_db)
    assert set(effects) == set(ids) and set(effects.values()) == {1}
    with psycopg.connect(sdk_db) as conn:  # applied in order: no other member applied any meanwhile
        assert [n for n, in conn.execute("SELECT n FROM effects ORDER BY applied")] == list(range(COUNT))
    lost = [e for e in running if e["event"] in ("partitions_lost", "partitions_revoked", "offset_commit_failed")
            or (e["event"] == "kafka_consume_error" and "maximum poll interval" in e["error"])]
    assert lost == [], "the member left its group in the middle of the batch"
    assert thread.consumer.totals.duplicates == 0  # nothing came again
    assert thread.sample("outbox_consumer_offset_commit_failures_total", consumer=config.name) == 0

