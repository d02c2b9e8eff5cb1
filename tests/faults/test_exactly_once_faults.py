"""Exactly-once mode (issue 20) under faults, with real relay processes on Apache Kafka
(tansu shows aborted records to read_committed consumers): SIGKILL at random points, a
replica paused past its lease while a peer takes over, a broker restart mid-transaction.
A read_committed consumer must see every event exactly once, in per-key order."""

from __future__ import annotations

import random
import threading
import time

from tests.fixtures.apache_kafka import ApacheKafkaBroker, apache_kafka_or_skip
from tests.fixtures.broker import create_topic
from tests.fixtures.exactly_once import assert_exactly_once, exactly_once_env
from tests.fixtures.outbox import (
    insert_rows,
    migrated,
    pending,
    relay_cmd,
    scalar,
    wait_drained,
)
from tests.fixtures.procs import wait_until

LEASE_S = 2.0


def _published(dsn: str) -> int:
    return int(scalar(dsn, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL"))


def _env(dsn: str, bootstrap: str, topic_name, **extra: object) -> dict[str, str]:
    return exactly_once_env(dsn, bootstrap, topic_name, lease_duration_s=LEASE_S, batch_size=200, **extra)


class Writer(threading.Thread):
    """Inserts ``total`` rows (insert_rows' keys and seqs) in commits of ``step`` rows."""

    def __init__(self, dsn: str, topic: str, total: int, step: int, pause_s: float) -> None:
        super().__init__(daemon=True, name="writer")
        self.dsn, self.topic, self.total, self.step, self.pause_s = dsn, topic, total, step, pause_s
        self.done = threading.Event()

    def run(self) -> None:
        for lo in range(0, self.total, self.step):
            insert_rows(self.dsn, self.topic, min(self.step, self.total - lo), keys=100, start=lo)
            time.sleep(self.pause_s)  # noqa: TID251 - paces the writer
        self.done.set()


def _check(bootstrap: str, topic: str, dsn: str) -> tuple[int, int]:
    return assert_exactly_once(bootstrap, topic, dsn, timeout_s=60, extra_wait_s=2)


def test_sigkill_twenty_times_read_committed_sees_every_event_once(
        db_dsn, kafka_broker, topic_name, spawn):
    dsn = migrated(db_dsn)
    topic = topic_name("eo-kill")
    create_topic(kafka_broker.bootstrap, topic, partitions=3)
    env = _env(dsn, kafka_broker.bootstrap, topic_name)
    writer = Writer(dsn, topic, total=20_000, step=250, pause_s=0.25)
    writer.start()
    rng = random.Random(20)
    kills = 0
    for i in range(20):
        relay = spawn(relay_cmd("run"), env=env, name=f"relay-{i}")
        relay.wait_for_log("exactly_once_shard_ready", timeout_s=60)
        before = _published(dsn)
        wait_until(lambda b=before, r=relay: _published(dsn) > b or pending(dsn) == 0
                   or not r.alive, timeout_s=60, message="no progress before the kill")
        time.sleep(rng.uniform(0.0, 1.0))  # noqa: TID251 - a random kill point (mid-transaction, mid-mark)
        relay.sigkill()
        relay.wait(10)
        kills += 1
    writer.join(120)
    assert writer.done.is_set()
    last = spawn(relay_cmd("run"), env=env, name="relay-last")
    last.wait_for_log("relay_started", timeout_s=60)  # its SIGTERM handler is installed
    wait_drained(dsn, timeout_s=120)
    last.sigterm()
    assert last.wait(30) == 0
    assert kills == 20
    events, records = _check(kafka_broker.bootstrap, topic, dsn)
    assert events == 20_000 and records == 20_000


def test_paused_replica_is_fenced_by_the_takeover(db_dsn, kafka_broker, topic_name, spawn):
    dsn = migrated(db_dsn)
    topic = topic_name("eo-pause")
    create_topic(kafka_broker.bootstrap, topic, partitions=3)
    env = _env(dsn, kafka_broker.bootstrap, topic_name)
    writer = Writer(dsn, topic, total=10_000, step=200, pause_s=0.1)
    a = spawn(relay_cmd("run"), env={**env, "OUTBOX_RELAY_OWNER": "relay-a"}, name="relay-a")
    a.wait_for_log("exactly_once_shard_ready", timeout_s=60)
    writer.start()
    wait_until(lambda: _published(dsn) >= 1000, timeout_s=60, message="relay-a never got going")
    a.sigstop()  # mid-stream: it may hold an open transaction and unmarked commits
    b = spawn(relay_cmd("run"), env={**env, "OUTBOX_RELAY_OWNER": "relay-b"}, name="relay-b")
    wait_until(lambda: int(scalar(dsn, "SELECT count(*) FROM outbox_relay_shards "
                                       "WHERE owner = 'relay-b'")) == 16,
               timeout_s=60, message="relay-b never took every shard over")
    before = _published(dsn)
    wait_until(lambda: _published(dsn) > before, timeout_s=60, message="relay-b publishes nothing")
    a.sigcont()  # it wakes up believing in its leases: Kafka and the database fence it
    a.wait_for_log("lease_lost", timeout_s=60)
    writer.join(120)
    wait_drained(dsn, timeout_s=120)
    for proc in (a, b):
        proc.sigterm()
        proc.wait(30)
    _check(kafka_broker.bootstrap, topic, dsn)


def test_broker_restart_mid_transaction_aborts_or_commits_never_half(
        db_dsn, topic_name, spawn):
    broker = apache_kafka_or_skip(lambda: ApacheKafkaBroker(auto_create=False))
    try:
        dsn = migrated(db_dsn)
        topic = topic_name("eo-restart")
        create_topic(broker.bootstrap, topic, partitions=3)
        env = _env(dsn, broker.bootstrap, topic_name)
        insert_rows(dsn, topic, 10_000, keys=100, per_tx=500)
        relay = spawn(relay_cmd("run"), env=env, name="relay")
        wait_until(lambda: _published(dsn) >= 1000, timeout_s=90, message="never got going")
        broker.restart()
        wait_drained(dsn, timeout_s=180)
        relay.sigterm()
        relay.wait(30)
        _check(broker.bootstrap, topic, dsn)
    finally:
        broker.close()


