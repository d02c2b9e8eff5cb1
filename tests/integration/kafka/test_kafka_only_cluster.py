"""Three Apache Kafka brokers (issue 13): a rolling restart under load loses nothing.

Replication factor 3, min.insync.replicas 2: while one broker is down the other two
acknowledge (acks=all), so the relay keeps publishing.  A writer commits about 2,000 events/s
for the whole restart; each broker in turn is stopped (controlled shutdown), started again
and waited for until every partition is back in sync before the next one goes.
"""

from __future__ import annotations

import threading
import time

import psycopg

from tests.fixtures.apache_kafka import ApacheKafkaCluster
from tests.fixtures.broker import create_topic, read_all
from tests.fixtures.outbox import (
    all_event_ids,
    check_delivery,
    relay_cmd,
    relay_env,
    wait_drained,
)

RATE_PER_S = 2000
TICK_S = 0.05  # the writer commits RATE_PER_S * TICK_S rows per tick
MAX_WRITE_S = 90.0  # the writer stops after this even if the restart is slower
#: The rows of tests.fixtures.outbox.insert_rows (key k<g % keys>, seq g // keys), one commit.
INSERT = ("INSERT INTO outbox (topic, key, payload) "
          "SELECT %(topic)s, 'k' || (g %% %(keys)s), "
          "jsonb_build_object('key', 'k' || (g %% %(keys)s), 'seq', g / %(keys)s, 'g', g) "
          "FROM generate_series(%(lo)s, %(hi)s - 1) AS g ORDER BY g")


class Writer(threading.Thread):
    """Commits `RATE_PER_S` rows a second over 50 keys until stopped (or MAX_WRITE_S)."""

    def __init__(self, dsn: str, topic: str) -> None:
        super().__init__(daemon=True, name="writer")
        self.dsn, self.topic = dsn, topic
        self.written = 0
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        per_tick = int(RATE_PER_S * TICK_S)
        started = time.monotonic()
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self.halt.is_set() and time.monotonic() - started < MAX_WRITE_S:
                    conn.execute(INSERT, {"topic": self.topic, "keys": 50, "lo": self.written,
                                          "hi": self.written + per_tick})
                    self.written += per_tick
                    # pacing, not waiting for a condition: the next commit is due then
                    self.halt.wait(max(0.0, started + self.written / RATE_PER_S - time.monotonic()))
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            self.error = exc


def test_rolling_restart_of_every_broker_under_load_loses_nothing(
        outbox_db, kafka_cluster: ApacheKafkaCluster, spawn, topic_name):
    topic = topic_name("rolling")
    create_topic_rf3(kafka_cluster, topic)
    relay = spawn(relay_cmd("run"), env=relay_env(outbox_db, kafka_cluster.bootstrap),
                  name="relay-rolling")
    writer = Writer(outbox_db, topic)
    writer.start()
    t0 = time.monotonic()
    for i in range(kafka_cluster.size):
        kafka_cluster.stop(i)
        kafka_cluster.start(i)
        kafka_cluster.wait_in_sync([topic], timeout_s=60)
    restart_s = time.monotonic() - t0
    writer.halt.set()
    writer.join(30)
    assert writer.error is None, writer.error
    rate = writer.written / max(restart_s, 1e-9)
    wait_drained(outbox_db, timeout_s=120)
    expected = all_event_ids(outbox_db)
    assert len(expected) == writer.written
    records = read_all(kafka_cluster.bootstrap, topic, expected, timeout_s=120, extra_wait_s=1.0)
    delivery = check_delivery(records, expected)
    print(f"rolling restart of 3 brokers: {restart_s:.1f}s, {writer.written} events "
          f"({rate:.0f}/s), lost {len(delivery.missing)}, duplicates {delivery.duplicates}, "
          f"order violations {len(delivery.order_violations)}")
    assert not delivery.missing, f"lost {len(delivery.missing)} events"
    assert not delivery.order_violations, delivery.order_violations[:10]
    assert writer.written >= RATE_PER_S * 5  # the restart ran under load for a while
    relay.sigterm()
    assert relay.wait(60) == 0, relay.log_tail()


def create_topic_rf3(cluster: ApacheKafkaCluster, name: str) -> None:
    """6 partitions, replication factor 3 (the cluster's default), in sync before the test."""
    from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

    from tests.fixtures.apache_kafka import admin_client

    admin = admin_client(cluster.bootstrap)
    admin.create_topics([NewTopic(name, num_partitions=6, replication_factor=3)])[name].result(30)
    del admin
    create_topic(cluster.bootstrap, name)  # waits until metadata shows it
    cluster.wait_in_sync([name], timeout_s=30)
