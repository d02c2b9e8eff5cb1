"""The relay rides out what brokers do in production (issue 15 items 2 and 3, issue 13).

* A partition without a leader (replication factor 1, its broker stopped for two minutes,
  on a three-broker Apache Kafka cluster): every other partition keeps flowing at no less
  than half its rate, `/healthz` stays healthy, nothing is lost, per-key order holds, and
  the waiting rows go out when the broker returns.
* The only broker stopped for five minutes: the loop never blocks, so the leases stay
  held, `/healthz` stays healthy and the process is never restarted; afterwards every
  event arrives, with no more copies than the in-flight window.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request

import psycopg
import pytest
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from relay.stalls import default_partition
from tests.fixtures.apache_kafka import ApacheKafkaBroker, apache_kafka_or_skip
from tests.fixtures.broker import create_topic, read_all
from tests.fixtures.outbox import (
    Writer,
    all_event_ids,
    check_delivery,
    relay_cmd,
    relay_env,
    wait_drained,
)
from tests.fixtures.procs import free_port, wait_until

KEYS = 60
BATCH, DEPTH = 200, 4


class HealthWatch:
    """Asks /healthz every second; remembers every answer that was not 200."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/healthz"
        self.failures: list[str] = []
        self.asked = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.asked += 1
            try:
                with urllib.request.urlopen(self.url, timeout=5) as answer:
                    if answer.status != 200:
                        self.failures.append(f"{answer.status}")
            except (urllib.error.URLError, OSError) as exc:
                self.failures.append(repr(exc))

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def marked_per_partition(dsn: str, since: float, until: float, partitions: int) -> dict[int, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT key, count(*) FROM outbox WHERE published_at >= to_timestamp(%s) "
                            "AND published_at < to_timestamp(%s) GROUP BY key",
                            (since, until)).fetchall()
    counts = dict.fromkeys(range(partitions), 0)
    for key, n in rows:
        counts[default_partition(key.encode(), partitions)] += n
    return counts


def test_a_partition_without_a_leader_stops_no_other_partition(outbox_db, kafka_cluster, topic_name,
                                                               spawn):
    topic = topic_name("rf1")
    admin = AdminClient({"bootstrap.servers": kafka_cluster.bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])[topic].result(30)
    leaders = wait_until(lambda: {p: m.leader for p, m in admin.list_topics(topic, timeout=10)
                                  .topics[topic].partitions.items()}, timeout_s=30)
    victim = leaders[0] - 1  # node ids are 1-based
    port = free_port()
    relay = spawn(relay_cmd("run"), env=relay_env(
        outbox_db, kafka_cluster.bootstrap, metrics_port=port, batch_size=BATCH,
        pipeline_depth=DEPTH), name="relay")
    relay.wait_for_log("http_listening", timeout_s=60)
    with Writer(outbox_db, topic, keys=KEYS, per_tick=10, pause_s=0.05), HealthWatch(port) as health:
        wait_until(lambda: marked_per_partition(outbox_db, 0, time.time() + 1, 3)[0] > 0,
                   timeout_s=60, message="the relay never published")
        t0 = time.time()
        time.sleep(20)  # noqa: TID251 - the baseline rate is measured over this window
        t1 = time.time()
        kafka_cluster.stop(victim)
        time.sleep(30)  # noqa: TID251 - the outage under test lasts two minutes
        status = json.loads(subprocess.run(
            relay_cmd("status", "--json", "--dsn", outbox_db), capture_output=True, text=True,
            check=True).stdout)
        time.sleep(90)  # noqa: TID251 - the rest of the two minutes
        t2 = time.time()
        kafka_cluster.start(victim)
        time.sleep(5)  # noqa: TID251 - a few more seconds of traffic after the return
    wait_drained(outbox_db, timeout_s=180)
    before = marked_per_partition(outbox_db, t0, t1, 3)
    during = marked_per_partition(outbox_db, t1 + 10, t2, 3)  # after the stall is noticed
    print(f"leaders {leaders}; rows marked per partition: 20 s before {before}, "
          f"{t2 - t1 - 10:.0f} s during {during}; healthz asked {health.asked}")
    assert during[0] == 0 or during[0] < before[0]  # partition 0 had no leader
    for p in (1, 2):
        rate_before, rate_during = before[p] / (t1 - t0), during[p] / (t2 - t1 - 10)
        assert rate_during >= rate_before / 2, (p, rate_before, rate_during)
    assert health.failures == []
    # What waits, and where: the status command reads it from the replica's heartbeat.
    waiting = {(r["topic"], r["partition"]) for r in status["stalled_partitions"]}
    assert waiting == {(topic, "0")}, status["stalled_partitions"]
    relay.sigterm()
    assert relay.wait(30) == 0, relay.log_tail()
    assert "partition_stalled" in relay.log_text()
    expected = all_event_ids(outbox_db)
    delivery = check_delivery(read_all(kafka_cluster.bootstrap, topic, expected=expected,
                                       timeout_s=120), expected)
    assert delivery.missing == set()
    assert delivery.order_violations == []
    print(f"{len(expected)} events, {delivery.duplicates} duplicates")


@pytest.fixture
def own_kafka():
    """A single-node Apache Kafka of this test's own, to stop for minutes (data on disk)."""
    broker = apache_kafka_or_skip(ApacheKafkaBroker)
    try:
        yield broker
    finally:
        broker.close()


def test_a_five_minute_broker_outage_restarts_nothing(outbox_db, own_kafka, topic_name, spawn):
    topic = topic_name("outage")
    create_topic(own_kafka.bootstrap, topic, partitions=3)
    port = free_port()
    relay = spawn(relay_cmd("run"), env=relay_env(
        outbox_db, own_kafka.bootstrap, metrics_port=port, batch_size=BATCH, pipeline_depth=DEPTH,
        lease_duration_s=10, heartbeat_interval_s=2), name="relay")
    relay.wait_for_log("http_listening", timeout_s=60)
    with Writer(outbox_db, topic, keys=KEYS, per_tick=5, pause_s=0.05), HealthWatch(port) as health:
        wait_until(lambda: marked_per_partition(outbox_db, 0, time.time() + 1, 3) != {0: 0, 1: 0, 2: 0},
                   timeout_s=60, message="the relay never published")
        own_kafka.stop()  # the whole cluster: every broker is gone
        deadline = time.monotonic() + 300
        lost_leases = []
        while time.monotonic() < deadline:  # the outage under test: five minutes
            with psycopg.connect(outbox_db, autocommit=True) as conn:
                held = conn.execute("SELECT count(*) FROM outbox_relay_shards WHERE "
                                    "lease_until > now() AND owner IS NOT NULL").fetchone()[0]
            if held != 16:
                lost_leases.append(held)
            time.sleep(5)  # noqa: TID251 - sampling the leases during the outage
        assert relay.alive, relay.log_tail()
        own_kafka.start()
        time.sleep(5)  # noqa: TID251 - a few more seconds of traffic after the return
    wait_drained(outbox_db, timeout_s=180)
    assert relay.alive
    relay.sigterm()
    assert relay.wait(30) == 0, relay.log_tail()
    assert lost_leases == []
    assert health.failures == []
    assert "lease_lost" not in relay.log_text()
    expected = all_event_ids(outbox_db)
    delivery = check_delivery(read_all(own_kafka.bootstrap, topic, expected=expected,
                                       timeout_s=120), expected)
    assert delivery.missing == set() and delivery.order_violations == []
    assert delivery.duplicates <= BATCH * DEPTH, delivery.duplicates
    print(f"{len(expected)} events, {delivery.duplicates} duplicates, healthz asked {health.asked}")
