"""One transaction longer than ``max.poll.interval.ms`` (a slow handler call, a slow batch), on
a real broker and PostgreSQL.

librdkafka leaves the group when nothing polled for ``max.poll.interval.ms``.  The consumer
polled between transactions only, so one transaction that long (a handler call, a batch:
``batch_size > 1``) made the member leave: ``_MAX_POLL_EXCEEDED``, its partitions moved to
another member and the records came again as duplicates, at every such transaction.  Now a
keeper thread polls beside the long transaction, the partitions paused
(:mod:`consumer_sdk.inbox_keeper`): the member keeps its partitions, and a rebalance during
the transaction is served there without the transaction's offset committed for a partition
taken away (the inbox keeps its effect once).

``max.poll.interval.ms`` at its least (librdkafka wants it >= ``session.timeout.ms``, and the
broker a session of 6 s at least); the slow work is 2.5 times as long.
"""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import psycopg
import pytest
from structlog.testing import capture_logs

from tests.fixtures.broker import create_topic
from tests.integration.sdk._support import (
    FAST_GROUP,
    effect_counts,
    make_config,
    produce_raw,
    record_effect,
    wait_for,
)

MAX_POLL_INTERVAL_MS = 6000
SLOW_S = 2.5 * MAX_POLL_INTERVAL_MS / 1000
PROPS = {**FAST_GROUP, "max.poll.interval.ms": MAX_POLL_INTERVAL_MS}


def _produce(bootstrap: str, topic: str, numbers: range, partition: int = 0) -> list[str]:
    """Events ``{"n": i}`` with fresh event ids to one partition, in order; returns the ids."""
    ids = [str(uuid.uuid4()) for _ in numbers]
    produce_raw(bootstrap, topic, [(b"k", json.dumps({"n": n}).encode(), [("event_id", i.encode())])
                                   for n, i in zip(numbers, ids, strict=True)], partition=partition)
    return ids


def _topic(bootstrap: str, name: str, partitions: int = 1) -> str:
    create_topic(bootstrap, name, partitions=partitions)
    create_topic(bootstrap, f"{name}.dlq", partitions=1)
    return name


def _group_offset(bootstrap: str, group: str, topic: str) -> int:
    """The offset ``group`` committed for partition 0 of ``topic``, as the broker says."""
    from confluent_kafka import Consumer, TopicPartition

    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "logger": PROPS["logger"]})
    try:
        [tp] = reader.committed([TopicPartition(topic, 0)], timeout=15)
        return int(tp.offset)
    finally:
        reader.close()


def _left(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a member that left its group (or lost its partitions) logs."""
    return [e for e in logs if e["event"] in ("partitions_lost", "partitions_revoked", "offset_commit_failed")
            or (e["event"] == "kafka_consume_error" and "maximum poll interval" in e["error"])]


@pytest.mark.parametrize("way", ["handler", "statements", "batch"])
def test_one_transaction_longer_than_max_poll_interval_keeps_the_member(
        sdk_db: str, broker: Any, topic_name: Any, run_consumer: Any, way: str) -> None:
    """One message whose handler (or statement) runs 2.5 intervals, or a batch of ten whose
    one transaction does: no revoke, no loss, every effect once, offsets to the end."""
    topic = _topic(broker.bootstrap, topic_name(f"long-{way}"))
    count = 10 if way == "batch" else 3
    ids = _produce(broker.bootstrap, topic, range(count))
    each_s = SLOW_S / count if way == "batch" else SLOW_S

    def handler(conn: psycopg.Connection[Any], message: Any) -> None:
        if way == "batch" or message.json()["n"] == 0:
            conn.execute("SELECT pg_sleep(%s)", (each_s,))
        record_effect(conn, message)

    def statements(message: Any) -> list[tuple[str, Any]]:
        slow = [("SELECT pg_sleep(%s)", (SLOW_S,))] if message.json()["n"] == 0 else []
        return [*slow, ("INSERT INTO effects (event_id, consumer, n) VALUES (%s, 'c', %s)",
                        (message.event_id, message.json()["n"]))]

    config = make_config(sdk_db, broker, topic, assignment="subscribe", kafka_properties=PROPS,
                         batch_size=count if way == "batch" else 1, check_retention=False)
    with capture_logs() as logs:
        thread = run_consumer(config, None, statements=statements) if way == "statements" \
            else run_consumer(config, handler)
        wait_for(lambda: thread.consumer.offsets.committed.get((topic, 0)) == count or thread.error is not None,
                 timeout_s=90, message=lambda: f"committed {thread.consumer.offsets.committed}, "
                                               f"applied {len(effect_counts(sdk_db))} of {count}")
        running = list(logs)  # not the revoke of the close
        thread.stop()
    effects = effect_counts(sdk_db)
    assert set(effects) == set(ids) and set(effects.values()) == {1}
    assert _left(running) == [], "the member left its group during the long transaction"
    assert thread.sample("outbox_consumer_rebalances_total", consumer=config.name, kind="assign") == 1
    assert thread.consumer.totals.duplicates == 0  # nothing came again
    assert [e for e in running if e["event"] == "membership_kept"], "no keeper polled beside the transaction"


def test_the_other_member_does_not_get_the_partition_of_a_long_transaction(
        sdk_db: str, kafka_broker: Any, topic_name: Any, run_consumer: Any) -> None:
    """Two members, one partition each; the one whose handler runs 2.5 intervals keeps its
    partition (before, it left: the group rebalanced and the other took both), and the other
    goes on with its own meanwhile."""
    broker = kafka_broker
    topic = _topic(broker.bootstrap, topic_name("long-pair"), partitions=2)
    slow_started = threading.Event()
    name = f"g-{uuid.uuid4().hex[:8]}"

    def handler(conn: psycopg.Connection[Any], message: Any) -> None:
        if message.json()["n"] == 0:
            slow_started.set()
            conn.execute("SELECT pg_sleep(%s)", (SLOW_S,))
        record_effect(conn, message)

    def config() -> Any:
        return make_config(sdk_db, broker, topic, name=name, assignment="subscribe", kafka_properties=PROPS,
                           check_retention=False)

    a = run_consumer(config(), handler)
    wait_for(lambda: len(a.consumer.assigned) == 2, timeout_s=60, message="A never got both partitions")
    b = run_consumer(config(), handler)
    wait_for(lambda: len(a.consumer.assigned) == 1 and len(b.consumer.assigned) == 1, timeout_s=60,
             message=lambda: f"no split: A {a.consumer.assigned}, B {b.consumer.assigned}")
    [(_, mine)] = a.consumer.assigned
    [(_, theirs)] = b.consumer.assigned

    def rebalances(member: Any) -> tuple[float, ...]:
        return tuple(member.sample("outbox_consumer_rebalances_total", consumer=name, kind=kind)
                     for kind in ("assign", "revoke", "lost"))

    before = rebalances(a), rebalances(b)
    with capture_logs() as logs:
        slow_ids = _produce(broker.bootstrap, topic, range(3), partition=mine)
        wait_for(slow_started.is_set, timeout_s=30, message="A's slow handler never started")
        other_ids = _produce(broker.bootstrap, topic, range(100, 110), partition=theirs)
        wait_for(lambda: set(other_ids) <= set(effect_counts(sdk_db)), timeout_s=30,
                 message="B applied nothing of its partition while A's handler ran")
        wait_for(lambda: a.consumer.offsets.committed.get((topic, mine)) == 3 or a.error is not None,
                 timeout_s=90, message=lambda: f"A committed {a.consumer.offsets.committed}")
        running = list(logs)
    assert (rebalances(a), rebalances(b)) == before, "the group rebalanced during A's long transaction"
    assert a.consumer.assigned == {(topic, mine)} and b.consumer.assigned == {(topic, theirs)}
    assert [e for e in running if e["event"] == "kafka_consume_error"] == []
    effects = effect_counts(sdk_db)
    assert set(effects) == set(slow_ids) | set(other_ids) and set(effects.values()) == {1}


def test_a_rebalance_during_a_long_transaction_commits_no_offset_of_a_moved_partition(
        sdk_db: str, kafka_broker: Any, topic_name: Any, run_consumer: Any) -> None:
    """A member joins while the first one's handler runs long: the keeper serves the
    rebalance (eager: everything revoked, then assigned again) on its thread.  The
    transaction in flight, committed after its partition was revoked, settles no offset
    (the partition's position is the next owner's; its event, claimed again there, waits
    for the row and is dropped); every effect once, the group's offsets at the end."""
    broker = kafka_broker
    topic = _topic(broker.bootstrap, topic_name("long-rebalance"))
    slow_started = threading.Event()
    name = f"g-{uuid.uuid4().hex[:8]}"

    def handler(conn: psycopg.Connection[Any], message: Any) -> None:
        if message.json()["n"] == 0 and not slow_started.is_set():
            slow_started.set()
            conn.execute("SELECT pg_sleep(%s)", (SLOW_S,))
        record_effect(conn, message)

    def config() -> Any:
        return make_config(sdk_db, broker, topic, name=name, assignment="subscribe", kafka_properties=PROPS,
                           check_retention=False)

    ids = _produce(broker.bootstrap, topic, range(5))
    with capture_logs() as logs:
        a = run_consumer(config(), handler)
        wait_for(slow_started.is_set, timeout_s=60, message="A's slow handler never started")
        b = run_consumer(config(), handler)
        wait_for(lambda: any(e["event"] == "partitions_revoked" for e in logs), timeout_s=60,
                 message="no rebalance while A's handler ran")
        revoked_while_slow = len(effect_counts(sdk_db)) == 0  # the slow transaction had not committed yet

        def at_end() -> bool:
            return any(m.consumer.offsets.committed.get((topic, 0)) == 5 for m in (a, b))

        wait_for(lambda: at_end() or a.error is not None or b.error is not None, timeout_s=90,
                 message=lambda: f"A committed {a.consumer.offsets.committed}, B {b.consumer.offsets.committed}")
        running = list(logs)
    assert revoked_while_slow, "the rebalance came after the long transaction, not during it"
    assert [e for e in running if e["event"] == "kafka_consume_error"] == []
    effects = effect_counts(sdk_db)
    assert set(effects) == set(ids) and set(effects.values()) == {1}
    owner = a if a.consumer.assigned else b
    assert owner.consumer.offsets.committed.get((topic, 0)) == 5


def test_stop_during_a_long_transaction_commits_it_without_leaving_the_group_first(
        sdk_db: str, kafka_broker: Any, topic_name: Any, run_consumer: Any) -> None:
    """stop() while the handler runs 2.5 intervals: the member keeps its partition until the
    transaction commits, then commits its offset and leaves (before, it had left the group
    halfway, and the offset could not be committed: "Unknown member")."""
    broker = kafka_broker
    topic = _topic(broker.bootstrap, topic_name("long-stop"))
    slow_started = threading.Event()

    def handler(conn: psycopg.Connection[Any], message: Any) -> None:
        if message.json()["n"] == 0:
            slow_started.set()
            conn.execute("SELECT pg_sleep(%s)", (SLOW_S,))
        record_effect(conn, message)

    ids = _produce(broker.bootstrap, topic, range(1))
    config = make_config(sdk_db, broker, topic, assignment="subscribe", kafka_properties=PROPS,
                         check_retention=False)
    with capture_logs() as logs:
        thread = run_consumer(config, handler)
        wait_for(slow_started.is_set, timeout_s=60, message="the slow handler never started")
        thread.stop(timeout_s=SLOW_S + 30)
    assert [e for e in logs if e["event"] in ("kafka_consume_error", "offset_commit_failed")] == []
    assert _group_offset(broker.bootstrap, config.group, topic) == 1
    assert set(effect_counts(sdk_db)) == set(ids)


def test_a_transaction_past_the_keepers_limit_lets_the_member_leave_and_applies_once(
        sdk_db: str, broker: Any, topic_name: Any, run_consumer: Any) -> None:
    """A handler running past keep_membership_max_intervals intervals (a hung one, as far as
    the keeper can tell; 1 here, to keep the test short, where the default is 3): the keeper
    stops polling beside it (membership_released), the member leaves its group one interval
    later as it did before the keeper (its other partitions would go to other members), and
    when the handler returns every effect is still applied once."""
    intervals = 1
    topic = _topic(broker.bootstrap, topic_name("long-released"))
    ids = _produce(broker.bootstrap, topic, range(3))
    hung_s = (intervals + 2.5) * MAX_POLL_INTERVAL_MS / 1000

    def handler(conn: psycopg.Connection[Any], message: Any) -> None:
        if message.json()["n"] == 0:
            conn.execute("SELECT pg_sleep(%s)", (hung_s,))
        record_effect(conn, message)

    config = make_config(sdk_db, broker, topic, assignment="subscribe", kafka_properties=PROPS, check_retention=False,
                         keep_membership_max_intervals=intervals)
    with capture_logs() as logs:
        thread = run_consumer(config, handler)
        wait_for(lambda: [e for e in logs if e["event"] == "membership_released"], timeout_s=90,
                 message=lambda: f"the keeper never let go: {[e['event'] for e in logs]}")
        wait_for(lambda: _left(logs), timeout_s=60, message="the member never left its group")
        wait_for(lambda: set(effect_counts(sdk_db)) == set(ids), timeout_s=120,
                 message=lambda: f"applied {len(effect_counts(sdk_db))} of {len(ids)}")
        thread.stop()
    effects = effect_counts(sdk_db)
    assert set(effects) == set(ids) and set(effects.values()) == {1}
    released = [e for e in logs if e["event"] == "membership_released"]
    assert len(released) == 1 and released[0]["busy_s"] >= intervals * MAX_POLL_INTERVAL_MS / 1000, released
    kept = [e for e in logs if e["event"] == "membership_kept"]
    assert len(kept) == 1, kept  # not taken again beside the same transaction
