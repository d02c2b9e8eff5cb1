"""Exactly-once mode on three Apache Kafka brokers: a partition without a leader (its only
replica's broker killed) holds up every shard transaction with a row for it, until its
messages time out (librdkafka caps message.timeout.ms at transaction.timeout.ms) and the
transaction is aborted.  The relay must say so, not only blame a hold-up of its own, and,
once the broker is back, deliver every event exactly once to a read_committed consumer.
While those transactions wait, only the leaderless partition is named stalled, not the
healthy ones whose rows wait in the same transactions, not even before the controller fences
the dead broker (Kafka's default broker.session.timeout.ms here, 9 s, not the fixtures' 4 s:
the metadata names its leader meanwhile).  And a position partition without a leader is not
a position topic deleted."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

from relay.exactly_once_position import POSITION_MISSING, ensure_position_topic, read_position
from relay.model import ShardId
from tests.fixtures.apache_kafka import ApacheKafkaCluster, admin_client, apache_kafka_or_skip
from tests.fixtures.exactly_once import drained_exactly_once, relay_with_a_partition_to_lose
from tests.fixtures.outbox import insert_rows, relay_cmd
from tests.fixtures.procs import Proc, free_port, wait_until

TRANSACTION_TIMEOUT_MS = 3000
STUCK_TRANSACTION_TIMEOUT_MS = 20_000  # longer than relay.stalls.STALL_AFTER_S: a stall is seen


@pytest.fixture(scope="module")
def kafka_cluster() -> Iterator[ApacheKafkaCluster]:
    """tests/conftest.py's three nodes, a dead one fenced after Kafka's default 9 s."""
    cluster = apache_kafka_or_skip(lambda: ApacheKafkaCluster(3, properties={"broker.session.timeout.ms": "9000"}))
    try:
        yield cluster
    finally:
        cluster.close()


def _failed(relay: Proc) -> list[dict[str, Any]]:
    return _logged(relay, "transaction_failed")


def test_a_partition_without_a_leader_is_named_when_transactions_time_out(
        outbox_db, kafka_cluster: ApacheKafkaCluster, spawn, topic_name):
    topic = topic_name("eo-leaderless")
    relay, _admin, index = relay_with_a_partition_to_lose(
        outbox_db, kafka_cluster, spawn, topic_name, topic, rows=300, name="relay-eo-leaderless",
        kafka_transaction_timeout_ms=TRANSACTION_TIMEOUT_MS)
    kafka_cluster.kill(index)  # partition 0 of the topic has no leader now
    try:
        insert_rows(outbox_db, topic, 300, keys=30, start=300)
        failed = wait_until(lambda: [e for e in _failed(relay) if e.get("timed_out")], timeout_s=60,
                            message=lambda: f"no transaction timed out: {relay.log_tail()}")
    finally:
        kafka_cluster.start(index)
    # Before: "the relay was held up, paused or starved of CPU" and nothing else of ours.
    for event in failed:
        assert "of its messages not delivered, a partition had no leader or a broker was out of reach" \
            in event["error"], event
    drained_exactly_once(relay, outbox_db, kafka_cluster.bootstrap, topic)


def test_only_the_partition_without_a_leader_is_named_stalled(
        outbox_db, kafka_cluster: ApacheKafkaCluster, spawn, topic_name):
    """Partition 0's only replica killed: every shard transaction with a row for it waits, and
    the rows of partitions 1 and 2 in it with it (delivered and not committed, or never sent:
    librdkafka adds a transaction's partitions together).  partition_stalled, the
    stalled-rows gauge and `outbox-relay status` named all three; then, until the dead broker
    was fenced (the rows stalled 5 s after the kill, fenced after 9 s), still all three: the
    metadata named a leader for each.  Now only partition 0."""
    topic = topic_name("eo-stalled")
    port = free_port()
    relay, admin, index = relay_with_a_partition_to_lose(
        outbox_db, kafka_cluster, spawn, topic_name, topic, rows=90, name="relay-eo-stalled",
        metrics_port=port, kafka_transaction_timeout_ms=STUCK_TRANSACTION_TIMEOUT_MS)
    kafka_cluster.kill(index)  # partition 0 of the topic has no leader, the metadata says so in 9 s
    try:
        insert_rows(outbox_db, topic, 300, keys=30, start=90)
        wait_until(lambda: _logged(relay, "partition_stalled"), timeout_s=60,
                   message=lambda: f"no partition_stalled: {relay.log_tail()}")
        status = wait_until(lambda: _status(outbox_db)["stalled_partitions"], timeout_s=30,
                            message="the status never showed a stalled partition")
        gauge = wait_until(lambda: _stalled_gauge(port, topic), timeout_s=30)
        logged = {(e["topic"], e["partition"]) for e in _logged(relay, "partition_stalled")}
    finally:
        kafka_cluster.start(index)
    assert logged == {(topic, 0)}, logged  # before: partitions 1 and 2 as well
    assert {(r["topic"], r["partition"]) for r in status} == {(topic, "0")}, status
    assert set(gauge) == {"0"}, gauge
    drained_exactly_once(relay, outbox_db, kafka_cluster.bootstrap, topic)


def _status(dsn: str) -> dict[str, Any]:
    done = subprocess.run(relay_cmd("status", "--json", "--dsn", dsn), capture_output=True, text=True,
                          check=True, timeout=60)
    status: dict[str, Any] = json.loads(done.stdout)
    return status


def _stalled_gauge(port: int, topic: str) -> dict[str, float]:
    """The partitions of ``topic`` in outbox_relay_stalled_rows: rows waiting."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:  # noqa: S310 - ours
        text = response.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("outbox_relay_stalled_rows{") and f'topic="{topic}"' in line:
            found[line.split('partition="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return found


def _logged(relay: Proc, name: str) -> list[dict[str, Any]]:
    return [json.loads(line[line.index("{"):]) for line in relay.log_text().splitlines()
            if f'"{name}"' in line]


def test_a_position_partition_without_a_leader_is_there_not_a_topic_to_create(
        kafka_cluster: ApacheKafkaCluster, topic_name):
    """The position topic made by hand with one replica, one broker killed: a shard whose
    position partition it led cannot read its last record, and the error is one of those
    of a deleted topic (POSITION_MISSING).  The relay said the topic was missing, at error
    level, and "created again" (rows may be sent again) though it was there all along: it
    now says so only when ``ensure_position_topic`` did create it."""
    position_topic = topic_name("pos")
    config = {"bootstrap.servers": kafka_cluster.bootstrap}
    admin = admin_client(kafka_cluster.bootstrap)
    admin.create_topics([NewTopic(position_topic, num_partitions=16, replication_factor=1,
                                  config={"cleanup.policy": "compact"})])[position_topic].result(30)
    leaders = wait_until(lambda: {p: m.leader for p, m in admin.list_topics(position_topic, timeout=5)
                                  .topics[position_topic].partitions.items()}, timeout_s=30, ignore=(KeyError,))
    index = [node.node_id for node in kafka_cluster.nodes].index(leaders[0])
    kafka_cluster.kill(index)
    try:
        # A broker may answer without the partition for a moment (KeyError): asked again.
        wait_until(lambda: admin.list_topics(position_topic, timeout=5).topics[position_topic]
                   .partitions[0].leader < 0, timeout_s=60, message="partition 0 kept a leader",
                   ignore=(KeyError,))
        with pytest.raises(KafkaException) as raised:
            read_position(config, position_topic, ShardId(0), timeout_s=2.0)
        assert raised.value.args[0].code() in POSITION_MISSING
        assert ensure_position_topic(config, position_topic, 16).created is False  # there: nothing created
    finally:
        kafka_cluster.start(index)
    assert ensure_position_topic(config, topic_name("pos-new"), 16).created is True
