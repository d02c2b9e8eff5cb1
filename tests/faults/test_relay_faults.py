"""Issue 2's faults, with real processes: SIGKILL, an unreachable broker, a database
restart, and the SIGTERM drain.  Every test counts every event afterwards."""

from __future__ import annotations

import json
import re
import threading

import psycopg
from confluent_kafka import Producer

from tests.fixtures.broker import create_topic, read_all
from tests.fixtures.outbox import (
    all_event_ids,
    check_delivery,
    insert_rows,
    migrated,
    pending,
    published_event_ids,
    relay_cmd,
    relay_env,
    scalar,
    wait_drained,
)
from tests.fixtures.procs import wait_until


def _published(dsn: str) -> int:
    return int(scalar(dsn, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL"))


def test_sigkill_mid_stream_loses_nothing_and_duplicates_stay_within_the_window(
        outbox_db, broker, topic, spawn):
    batch, depth = 200, 4
    insert_rows(outbox_db, topic, 40_000, keys=200, per_tx=2000)
    expected = all_event_ids(outbox_db)
    env = relay_env(outbox_db, broker.bootstrap, batch_size=batch, pipeline_depth=depth)
    first = spawn(relay_cmd("run"), env=env, name="relay-a")
    wait_until(lambda: _published(outbox_db) >= 5000, timeout_s=60,
               message="the relay never got going")
    first.sigkill()
    assert first.wait(10) == -9
    left = pending(outbox_db)
    assert left > 0, "the kill came too late to be mid-stream"

    second = spawn(relay_cmd("run"), env=env, name="relay-b")
    wait_drained(outbox_db, timeout_s=120)
    second.sigterm()
    assert second.wait(30) == 0

    records = read_all(broker.bootstrap, topic, expected=expected, timeout_s=60, extra_wait_s=1)
    delivery = check_delivery(records, expected)
    assert delivery.missing == set()
    assert delivery.order_violations == []
    # What was acknowledged but not yet marked when the process died is sent again:
    # at most the in-flight window of batches.
    assert delivery.duplicates <= batch * depth, delivery.duplicates


def test_broker_unreachable_at_start_then_available(outbox_db, proxied_broker, topic_name, spawn):
    tansu, proxy = proxied_broker
    topic = topic_name("late-broker")
    create_topic(tansu.bootstrap, topic, partitions=3)
    proxy.cut()
    insert_rows(outbox_db, topic, 2000, keys=50)
    expected = all_event_ids(outbox_db)
    relay = spawn(relay_cmd("run"), env=relay_env(outbox_db, tansu.bootstrap), name="relay")
    relay.wait_for_log("broker_unavailable", timeout_s=30)
    assert relay.alive
    assert pending(outbox_db) == 2000  # nothing marked while nothing was acknowledged

    proxy.restore()
    wait_drained(outbox_db, timeout_s=120)
    relay.wait_for_log("broker_recovered", timeout_s=30)
    relay.sigterm()
    assert relay.wait(30) == 0
    delivery = check_delivery(read_all(tansu.bootstrap, topic, expected=expected, timeout_s=60), expected)
    assert delivery.missing == set() and delivery.order_violations == []


def test_database_restart_under_a_running_relay(own_db_dsn, own_pg_running, broker, topic, spawn):
    dsn = migrated(own_db_dsn)
    insert_rows(dsn, topic, 3000, keys=50)
    relay = spawn(relay_cmd("run"), env=relay_env(dsn, broker.bootstrap), name="relay")
    wait_drained(dsn, timeout_s=60)

    since = relay.log_size()
    own_pg_running.stop()
    relay.wait_for_log("database_unavailable", timeout_s=30, since=since)
    own_pg_running.start()
    insert_rows(dsn, topic, 3000, keys=50, start=3000)
    expected = all_event_ids(dsn)
    wait_drained(dsn, timeout_s=120)
    relay.wait_for_log("database_recovered", timeout_s=30, since=since)
    assert relay.alive
    relay.sigterm()
    assert relay.wait(30) == 0
    delivery = check_delivery(read_all(broker.bootstrap, topic, expected=expected, timeout_s=60), expected)
    assert delivery.missing == set() and delivery.order_violations == []


def test_sigterm_drains_and_every_acknowledged_row_is_marked(outbox_db, proxied_broker, topic_name,
                                                             spawn):
    tansu, proxy = proxied_broker
    topic = topic_name("drain")
    create_topic(tansu.bootstrap, topic, partitions=3)
    proxy.set_delay(300)  # acknowledgements take a while: SIGTERM finds rows in flight
    stop = threading.Event()

    def keep_writing() -> None:
        start = 0
        while not stop.is_set():
            insert_rows(outbox_db, topic, 200, keys=20, start=start)
            start += 200
            stop.wait(0.05)

    writer = threading.Thread(target=keep_writing, daemon=True)
    writer.start()
    relay = spawn(relay_cmd("run"), env=relay_env(outbox_db, tansu.bootstrap, batch_size=100),
                  name="relay")
    try:
        wait_until(lambda: _published(outbox_db) >= 500, timeout_s=60, message="nothing published")
    finally:
        stop.set()
        writer.join()
    relay.sigterm()
    assert relay.wait(30) == 0
    draining = re.search(r'\{[^\n]*"relay_draining"[^\n]*\}', relay.log_text())
    assert draining, relay.log_tail()
    assert json.loads(draining.group(0))["in_flight"] > 0, "SIGTERM found nothing in flight"

    proxy.set_delay(0)
    marked = published_event_ids(outbox_db)
    records = read_all(tansu.bootstrap, topic, expected=marked, timeout_s=60, extra_wait_s=2)
    in_kafka = {r.headers["event_id"].decode() for r in records}
    # Every row the broker has was acknowledged and marked before the exit; nothing was
    # marked that the broker does not have.
    assert in_kafka == marked


LEASE_AUDIT = """
CREATE TABLE lease_audit (shard int, at timestamptz DEFAULT clock_timestamp());
CREATE FUNCTION audit_lease() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO lease_audit (shard) VALUES (NEW.shard);
  RETURN NULL;
END $$;
CREATE TRIGGER audit_lease AFTER UPDATE ON outbox_relay_shards FOR EACH ROW
  WHEN (NEW.token <> OLD.token) EXECUTE FUNCTION audit_lease();
"""


def test_a_starting_relay_publishes_as_soon_as_it_holds_a_lease(outbox_db, broker, topic, spawn):
    # Every relay that starts (a deploy, a restart, a replica joining) takes leases on
    # shards whose rows then wait for it.  Until issue 18's twenty-fourth pass its Kafka
    # client, made a moment before the leases, got its idempotent producer id on
    # librdkafka's own 500 ms timer when no broker had answered yet (on tansu always:
    # its first row went 0.7-1 s after its first lease; on Apache Kafka when the connection
    # took longer than the leases), and a rolling restart of four relays at 1,000
    # events/s read commit -> ack 1.0 s at each hand-over.  Now the relay has the client
    # answered by the cluster before it takes a lease (Publisher.warm_up).
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(LEASE_AUDIT)
    # A cluster that has just started answers the first producer-id request with "coordinator
    # load in progress", and librdkafka asks again on its timer: not what is measured here.
    create_topic(broker.bootstrap, f"{topic}.warm", partitions=1)
    warm = Producer({"bootstrap.servers": broker.bootstrap, "enable.idempotence": True})
    warm.produce(f"{topic}.warm", value=b"warm")
    assert warm.flush(30) == 0
    # A claim, a produce and its acknowledgement, and the mark's transaction starting:
    # tens of milliseconds here (56-175 ms in 16 runs on a 2-core machine, two of them
    # beside two busy loops; 377 ms once in CI, 450+ ms a few times, beside the other test
    # workers).  The timer alone was 500 ms from the client's creation, on every start
    # (0.99 / 0.99 / 0.49 s with warm_up taken out): so a relay is started up to three
    # times, each on rows of its own, and one start under the bound passes; the defect
    # stays above it on all three.
    gaps = []
    for start in range(3):
        insert_rows(outbox_db, topic, 2_000, start=start * 2_000)
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            (began,) = conn.execute("SELECT clock_timestamp()").fetchone()
        relay = spawn(relay_cmd("run"), env=relay_env(outbox_db, broker.bootstrap), name=f"relay{start}")
        wait_drained(outbox_db, timeout_s=60)
        relay.sigterm()
        assert relay.wait(30) == 0
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            leased, marked = conn.execute(
                "SELECT (SELECT min(at) FROM lease_audit WHERE at > %(t)s), "
                "(SELECT min(published_at) FROM outbox WHERE published_at > %(t)s)", {"t": began}).fetchone()
        gaps.append((marked - leased).total_seconds())
        print(f"start {start}: first lease -> first mark: {gaps[-1] * 1000:.0f} ms")
        assert gaps[-1] >= 0, (gaps, relay.log_tail())
        if gaps[-1] < 0.4:
            break
    assert min(gaps) < 0.4, (gaps, relay.log_tail())
    expected = all_event_ids(outbox_db)
    delivery = check_delivery(read_all(broker.bootstrap, topic, expected=expected, timeout_s=60), expected)
    assert delivery.missing == set() and delivery.order_violations == []
    assert delivery.duplicates == 0
