"""Two consumers in one group, with rebalances in the middle of the stream (a member
joins, then the first one leaves): every effect still happens exactly once."""

from __future__ import annotations

import threading
import time
from collections import Counter

import psycopg

from consumer_sdk import InboxMessage, RetryPolicy
from tests.fixtures.broker import create_topic
from tests.integration.sdk._support import (
    effect_counts,
    make_config,
    publish_all,
    record_effect,
    wait_for,
    write_numbered,
)

N = 1200
WORK_S = 0.002  # simulated work per event, so the stream outlasts two rebalances


def test_a_member_joins_and_another_leaves_mid_stream_effects_stay_exactly_once(
        sdk_db, broker, topic_name, run_consumer):
    topic = topic_name("group")
    create_topic(broker.bootstrap, topic, partitions=4)
    create_topic(broker.bootstrap, f"{topic}.dlq", partitions=1)  # Apache Kafka does not auto-create it
    ids = write_numbered(sdk_db, topic, N, keys=50)
    publish_all(sdk_db, broker.bootstrap)
    applied: Counter[str] = Counter()
    first_attempts: set[int] = set()
    lock = threading.Lock()

    def handler_for(member: str):
        def handler(conn: psycopg.Connection, message: InboxMessage) -> None:
            n = message.json()["n"]
            with lock:
                first = n not in first_attempts
                first_attempts.add(n)
            if n % 199 == 0 and first:  # a transient failure: a real, paused back-off inside the group
                raise RuntimeError("try again")
            time.sleep(WORK_S)  # noqa: TID251 - the handler's work takes this long
            record_effect(conn, message, consumer=member)
            with lock:
                applied[member] += 1
        return handler

    retry = RetryPolicy(max_attempts=5, backoff_initial_s=0.2, backoff_max_s=0.5)
    config = make_config(sdk_db, broker, topic, name="orders-projector", assignment="subscribe",
                         batch_size=20, retry=retry)
    a = run_consumer(config, handler_for("a"))
    wait_for(lambda: applied["a"] >= 300, timeout_s=30, message="member a never got going")
    b = run_consumer(config, handler_for("b"))
    wait_for(lambda: applied["b"] >= 50, timeout_s=30, message="member b never got partitions")
    assert a.consumer.assigned and b.consumer.assigned
    a.stop()  # leaves the group: its partitions are revoked (offsets committed) and move to b
    assert len(effect_counts(sdk_db)) < N, "the stream ended before the second rebalance"
    wait_for(lambda: len(effect_counts(sdk_db)) >= N, timeout_s=90,  # a loaded 2-core box
             message=f"not all applied: {applied}")
    b.stop()

    effects = effect_counts(sdk_db)
    assert set(effects) == set(ids)
    assert set(effects.values()) == {1}
    # Handler runs that returned: each event once, plus the events before a failing one in
    # its batch, whose first run rolled back with the failure and ran again (no savepoints).
    failing = [n for n in range(N) if n % 199 == 0]
    assert N <= applied["a"] + applied["b"] <= N + len(failing) * (config.batch_size - 1)
    assert a.sample("outbox_consumer_rebalances_total", consumer=config.name, kind="revoke") >= 1
    assert b.sample("outbox_consumer_rebalances_total", consumer=config.name, kind="assign") >= 2
