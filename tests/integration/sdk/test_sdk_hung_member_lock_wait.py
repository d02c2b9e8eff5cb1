"""A consumer whose handler hung with its transaction open, seen by the partition's owner
(real PostgreSQL, Apache Kafka).

A's handler hangs on event 0 (it waits for an advisory lock the test holds), its transaction
open with event 0's inbox row inserted.  A member keeps its partitions while its handler
runs (its keeper polls beside the transaction), so A here reads the partition outside the
group (``assignment="assign"``), as a member that left the group with its transaction open
(its process stopped, or cut from Kafka) would: B, the group's member, claims event 0 and
waits on A's row lock.  That
wait was silent (no log line: an audit); now B's ``database_lock_wait`` names the backend
that holds it up (A's pid, its application_name ``outbox-consumer:<name>``), and B's gauge
``outbox_consumer_lock_wait_seconds`` shows the wait (0 again once it is over).  Released, A's
handler returns and every event is applied once.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
from structlog.testing import capture_logs

from tests.fixtures.procs import wait_until
from tests.integration.sdk._support import (
    FAST_GROUP,
    effect_counts,
    make_config,
    numbered_events_on_kafka,
    record_effect,
    wait_for,
)


def _hung_pid(dsn: str) -> int | None:
    """The consumer backend waiting for the test's advisory lock (A's hung handler)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT l.pid FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                           "WHERE NOT l.granted AND l.locktype = 'advisory' "
                           "AND a.application_name LIKE 'outbox-consumer:%%'").fetchone()
    return int(row[0]) if row else None


def test_the_next_owner_names_the_hung_member_it_waits_on(sdk_db, kafka_broker, topic_name, run_consumer):
    topic = topic_name("hung")
    ids = numbered_events_on_kafka(kafka_broker.bootstrap, topic, 5)
    holder = psycopg.connect(sdk_db, autocommit=True)
    holder.execute("SELECT pg_advisory_lock(42)")

    def handler(conn: Any, message: Any) -> None:
        if message.json()["n"] == 0:
            conn.execute("SELECT pg_advisory_lock_shared(42)")  # hangs while the test holds it
        record_effect(conn, message)

    name = f"g-{uuid.uuid4().hex[:8]}"
    props = {**FAST_GROUP, "max.poll.interval.ms": 6000}

    def config() -> Any:
        return make_config(sdk_db, kafka_broker, topic, name=name, assignment="subscribe", kafka_properties=props,
                           check_retention=False)

    try:
        with capture_logs() as logs:
            a = run_consumer(make_config(sdk_db, kafka_broker, topic, name=name, assignment="assign",
                                         kafka_properties=props, check_retention=False), handler)
            wait_for(lambda: _hung_pid(sdk_db) is not None, timeout_s=30, message="A never hung")
            hung = _hung_pid(sdk_db)
            b = run_consumer(config(), record_effect)

            def b_waits_on_a() -> list[dict[str, Any]]:
                return [e for e in logs if e["event"] == "database_lock_wait" and hung in e["blocking_pids"]]

            def b_gauge() -> float:
                value = b.consumer.metrics.registry.get_sample_value("outbox_consumer_lock_wait_seconds",
                                                                     {"consumer": name})
                assert value is not None, "B exports no outbox_consumer_lock_wait_seconds"
                return value

            wait_for(b_waits_on_a, timeout_s=90, message="B never said what it waits on")
            # B's gauge shows the wait (the watch looks after 5 s in a batch) and grows with it.
            seen = wait_until(lambda: b_gauge() >= 5.0 and b_gauge(), timeout_s=30,
                              message=lambda: f"B's lock wait gauge stayed at {b_gauge()}")
            wait_until(lambda: b_gauge() > seen, timeout_s=30, message=lambda: f"B's gauge stuck at {seen}")
            [wait] = b_waits_on_a()[:1]
            assert wait["log_level"] == "warning" and wait["consumer"] == name
            assert wait["blockers"] == [f"outbox-consumer:{name}"]
            assert f"held by backend pid {hung} (outbox-consumer:{name}" in wait["detail"]
            assert "max.poll.interval.ms" in wait["hint"]
            holder.close()  # A's handler returns, A commits, B's claim finds a duplicate
            wait_for(lambda: len(effect_counts(sdk_db)) == len(ids), timeout_s=60, message="not all applied")
            wait_for(lambda: any(e["event"] == "database_wait_over" for e in logs), timeout_s=30,
                     message="the end of the wait was not said")
            wait_until(lambda: b_gauge() == 0.0, timeout_s=30,
                       message=lambda: f"B's lock wait gauge stayed at {b_gauge()} after the wait")
            a.stop()
            b.stop()
    finally:
        holder.close()
    effects = effect_counts(sdk_db)
    assert set(effects) == set(ids) and set(effects.values()) == {1}
