"""Every event delivered twice (the relay run twice over the same rows): each effect once."""

from __future__ import annotations

import psycopg
import pytest

from consumer_sdk import InboxMessage
from tests.fixtures.broker import read_all
from tests.integration.sdk._support import (
    counter,
    effect_counts,
    make_config,
    publish_all,
    wait_settled,
    write_numbered,
)


@pytest.mark.parametrize("batch_size", [1, 64], ids=["single", "batched"])
def test_every_event_delivered_twice_is_applied_once(sdk_db, broker, sdk_topic, run_consumer, batch_size):
    n = 300
    ids = write_numbered(sdk_db, sdk_topic, n)
    publish_all(sdk_db, broker.bootstrap, times=2)
    assert len(read_all(broker.bootstrap, sdk_topic, expected=2 * n, timeout_s=30)) == 2 * n

    config = make_config(sdk_db, broker, sdk_topic, batch_size=batch_size)

    def handler(conn: psycopg.Connection, message: InboxMessage) -> None:
        from tests.integration.sdk._support import record_effect

        record_effect(conn, message)

    thread = run_consumer(config, handler)
    wait_settled(thread, 2 * n)
    thread.stop()

    effects = effect_counts(sdk_db)
    assert set(effects) == set(ids)
    assert set(effects.values()) == {1}
    assert counter(sdk_db) == n
    labels = {"consumer": config.name, "topic": sdk_topic}
    assert thread.sample("outbox_consumer_processed_total", **labels) == n
    assert thread.sample("outbox_consumer_duplicates_dropped_total", **labels) == n
    assert thread.sample("outbox_consumer_payload_mismatches_total", **labels) == 0
    with psycopg.connect(sdk_db) as conn:
        inbox = conn.execute("SELECT count(*) FROM outbox_inbox WHERE consumer = %s", (config.name,)).fetchone()
    assert inbox == (n,)


def test_a_second_consumer_name_applies_the_events_again(sdk_db, broker, sdk_topic, run_consumer):
    """The inbox key is (consumer, event_id): two services each apply an event once."""
    ids = write_numbered(sdk_db, sdk_topic, 50)
    publish_all(sdk_db, broker.bootstrap)
    from tests.integration.sdk._support import record_effect

    threads = []
    for name in ("billing", "shipping"):
        def handler(conn: psycopg.Connection, message: InboxMessage, name: str = name) -> None:
            record_effect(conn, message, consumer=name)

        threads.append(run_consumer(make_config(sdk_db, broker, sdk_topic, name=name), handler))
    for thread in threads:
        wait_settled(thread, 50)
        thread.stop()
    assert counter(sdk_db, "billing") == counter(sdk_db, "shipping") == 50
    assert set(effect_counts(sdk_db).values()) == {2} and len(effect_counts(sdk_db)) == len(ids)
