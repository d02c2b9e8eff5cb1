"""A lone exactly-once replica paused (SIGSTOP) past ``transaction.timeout.ms``: the broker
aborts its open transaction on the timeout (bumping the producer's epoch), nobody takes the
shard over.  After SIGCONT the relay must say so, not that another owner fenced it, and go
on: a new producer, recovery, the rows sent again, each exactly once.  Real Apache Kafka (a
broker that aborts timed-out transactions every 0.5 s) and a real relay process, its lease
(300 s) outlasting the pause: no other replica exists, none could take a shard.  The broker's
abort is seen from outside, while the relay is stopped, in the partitions' last stable
offsets reaching their high watermarks.

The relay keeps its leases and recovers in place.  It gave the shard's lease up before and
took it again only at its next heartbeat (every 100 s here): the rows written before the
resume waited for it, for nothing, since no other replica exists."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import IsolationLevel, TopicPartition
from confluent_kafka.admin import OffsetSpec  # type: ignore[attr-defined]

from tests.fixtures.apache_kafka import ApacheKafkaBroker, admin_client, apache_kafka_or_skip
from tests.fixtures.broker import create_topic
from tests.fixtures.exactly_once import assert_exactly_once, exactly_once_env
from tests.fixtures.outbox import (
    insert_rows,
    migrated,
    relay_cmd,
    scalar,
    wait_drained,
)
from tests.fixtures.procs import Proc, free_port, wait_until

TRANSACTION_TIMEOUT_MS = 1500
LEASE_S, HEARTBEAT_S = 300, 100
#: After the resume, every row written before it is published within this (recovering in
#: place takes a second or two; a lease given up came back at the heartbeat, 100 s).
RECOVERY_BOUND_S = 40.0
PAUSES = 30  # a pause lands outside every open transaction now and then: paused again


@pytest.fixture
def timing_out_kafka() -> Iterator[ApacheKafkaBroker]:
    broker = apache_kafka_or_skip(lambda: ApacheKafkaBroker(properties={
        "transaction.abort.timed.out.transaction.cleanup.interval.ms": "500"}))
    try:
        yield broker
    finally:
        broker.close()


def _events(relay: Proc, name: str) -> list[dict[str, Any]]:
    found = []
    for line in relay.log_text().splitlines():
        if f'"{name}"' in line:
            try:
                found.append(json.loads(line[line.index("{"):]))
            except ValueError:
                continue
    return found


def _published(dsn: str) -> int:
    return int(scalar(dsn, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL"))


def _pending_up_to(dsn: str, last_id: int) -> int:
    return int(scalar(dsn, "SELECT count(*) FROM outbox WHERE id <= %(last)s AND published_at IS NULL",
                      {"last": last_id}))


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def _offsets(admin: Any, partitions: list[TopicPartition], level: IsolationLevel) -> dict[tuple[str, int], int]:
    futures = admin.list_offsets({tp: OffsetSpec.latest() for tp in partitions}, isolation_level=level,
                                 request_timeout=10)
    return {(tp.topic, tp.partition): int(f.result().offset) for tp, f in futures.items()}


def _open_transactions(admin: Any, partitions: list[TopicPartition]) -> dict[tuple[str, int], int]:
    """The partitions an open transaction wrote to (last stable offset under the high
    watermark), with their high watermark."""
    high = _offsets(admin, partitions, IsolationLevel.READ_UNCOMMITTED)
    stable = _offsets(admin, partitions, IsolationLevel.READ_COMMITTED)
    return {tp: end for tp, end in high.items() if stable[tp] < end}


def _pause_through_a_timeout(relay: Proc, admin: Any, partitions: list[TopicPartition]) -> bool:
    """SIGSTOP ``relay``; when it holds a transaction open, wait (stopped) until the broker
    ended it (its last stable offsets reach where the high watermarks were); SIGCONT.  True
    when the pause outlasted an open transaction (one that ended sooner was a commit already
    on its way)."""
    relay.sigstop()
    stopped = time.monotonic()
    try:
        held = _open_transactions(admin, partitions)
        if not held:
            return False
        wait_until(lambda: all(stable >= held[tp] for tp, stable in _offsets(
            admin, partitions, IsolationLevel.READ_COMMITTED).items() if tp in held),
            timeout_s=10 * TRANSACTION_TIMEOUT_MS / 1000, interval_s=0.2,
            message="the broker never ended the paused relay's transaction")
        return time.monotonic() - stopped >= TRANSACTION_TIMEOUT_MS / 1000
    finally:
        relay.sigcont()


def test_a_lone_replica_paused_past_its_transaction_timeout_is_not_fenced(
        db_dsn, timing_out_kafka, topic_name, spawn):
    broker = timing_out_kafka
    dsn = migrated(db_dsn)
    topic = topic_name("eo-timeout")
    create_topic(broker.bootstrap, topic, partitions=3)
    port = free_port()
    env = exactly_once_env(dsn, broker.bootstrap, topic_name, lease_duration_s=LEASE_S,
                           heartbeat_interval_s=HEARTBEAT_S, metrics_port=port,
                           kafka_transaction_timeout_ms=TRANSACTION_TIMEOUT_MS)
    relay = spawn(relay_cmd("run"), env=env, name="relay")
    relay.wait_for_log("relay_started", timeout_s=60)
    admin = admin_client(broker.bootstrap)
    partitions = [TopicPartition(topic, i) for i in range(3)]
    stop = threading.Event()
    written = [0]

    def write() -> None:  # a steady stream: some shard's transaction is open most of the time
        while not stop.is_set():
            insert_rows(dsn, topic, 50, keys=100, start=written[0])
            written[0] += 50
            stop.wait(0.02)

    writer = threading.Thread(target=write, daemon=True, name="writer")
    writer.start()
    try:
        aborted = 0
        for _ in range(PAUSES):
            before = _published(dsn)
            wait_until(lambda b=before: _published(dsn) > b, timeout_s=30, message="nothing published")
            if _pause_through_a_timeout(relay, admin, partitions):
                aborted += 1
                break
        assert aborted, "no pause found an open transaction"
        resumed, written_before = time.monotonic(), int(scalar(dsn, "SELECT max(id) FROM outbox"))
        wait_until(lambda: _events(relay, "transaction_failed"), timeout_s=30,
                   message=lambda: relay.log_tail())
        wait_until(lambda: not _pending_up_to(dsn, written_before), timeout_s=RECOVERY_BOUND_S, interval_s=0.2,
                   message=lambda: (f"{_pending_up_to(dsn, written_before)} rows written before the resume "
                                    f"still pending {time.monotonic() - resumed:.1f} s after it; lease_lost: "
                                    f"{_events(relay, 'lease_lost')}"))
    finally:
        stop.set()
        writer.join(10)
    wait_drained(dsn, timeout_s=120)
    failed = _events(relay, "transaction_failed")
    # Before: "fenced": true, "Failed to end transaction: Local: This instance has been fenced
    # by a newer instance", lease_lost kafka_producer_fenced, result="fenced" in the metric.
    assert any(event.get("timed_out") for event in failed), failed
    assert not [event for event in failed if event["fenced"]], failed
    for event in failed:
        if event.get("timed_out"):
            assert event["error"].startswith("the transaction timed out (open "), event
            assert f"transaction.timeout.ms {TRANSACTION_TIMEOUT_MS} ms: the relay was held up" in event["error"]
    # Before: lease_lost kafka_transaction_timed_out, the shard idle until the next heartbeat.
    assert _events(relay, "lease_lost") == []
    recovering = {event["shard"] for event in _events(relay, "exactly_once_shard_recovering")}
    assert recovering and recovering <= {event["shard"] for event in failed if event.get("timed_out")}
    metrics = _metrics(port)
    assert 'outbox_relay_transactions_total{result="fenced"} 0.0' in metrics
    assert 'outbox_relay_transactions_total{result="aborted"} 0.0' not in metrics
    relay.sigterm()
    assert relay.wait(30) == 0
    assert_exactly_once(broker.bootstrap, topic, dsn, timeout_s=60)
