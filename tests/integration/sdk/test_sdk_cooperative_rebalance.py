"""A ``cooperative-sticky`` group while events flow: a second member joins, a third (a real
process) joins and is SIGKILLed, the first leaves.  Every event's effect exists exactly once,
the group's committed offsets end at the end of every partition (none left behind, none left
paused), and the rebalances were incremental: the first member kept partitions through the
second one's join, the second took the killed member's partitions while keeping its own.

With the cooperative protocol confluent-kafka calls on_assign/on_revoke with the increment
only, and assigns or unassigns it itself (incremental_assign/incremental_unassign) when the
callback does not; the SDK's callbacks commit what was applied on the revoked partitions and
forget only them (consumer_sdk/inbox_group.py).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import structlog
from confluent_kafka import Consumer, TopicPartition
from structlog.testing import capture_logs

from consumer_sdk import InboxMessage, RetryPolicy
from tests.fixtures.broker import create_topic
from tests.fixtures.procs import Proc, wait_until
from tests.integration.sdk._support import (
    FAST_GROUP,
    ConsumerThread,
    effect_counts,
    make_config,
    produce_raw,
    record_effect,
)

ROOT = Path(__file__).resolve().parents[3]
MEMBER = Path(__file__).with_name("_cooperative_member.py")
PARTITIONS = 6
CHUNKS = 6  # produced along the way, between the group's changes
PER_PARTITION = 40  # events per partition in each chunk
WORK_S = 0.002  # simulated work per event, so the stream outlasts the rebalances
COOPERATIVE = {**FAST_GROUP, "partition.assignment.strategy": "cooperative-sticky"}
GIVEN = re.compile(r"partitions_assigned .*partitions=\['")  # a member's log line: some partitions came


def produce_chunk(bootstrap: str, topic: str, chunk: int, expected: set[str]) -> None:
    """``PER_PARTITION`` events to every partition, each with a fresh event id."""
    for p in range(PARTITIONS):
        batch = []
        for i in range(PER_PARTITION):
            event_id = str(uuid.uuid4())
            expected.add(event_id)
            batch.append((f"k{p}".encode(), json.dumps({"n": chunk * 100_000 + p * 1000 + i}).encode(),
                          [("event_id", event_id.encode())]))
        produce_raw(bootstrap, topic, batch, partition=p)


def applied_by(dsn: str, member: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM effects WHERE consumer = %s", (member,)).fetchone()
    return int(row[0]) if row else 0


def committed_offsets(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    """The group's committed offset of every partition (read without joining the group)."""
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                       "logger": logging.getLogger("tests.sdk.cooperative")})
    try:
        parts = reader.committed([TopicPartition(topic, p) for p in range(PARTITIONS)], timeout=10)
    finally:
        reader.close()
    return {tp.partition: tp.offset for tp in parts}


def ownership(logs: list[dict[str, Any]], member: str) -> tuple[bool, bool]:
    """Replays ``member``'s rebalance lines: (a revoke left it partitions, an assign came
    while it owned some).  An eager rebalance revokes everything first, so neither happens."""
    owned: set[str] = set()
    kept = added = False
    for line in logs:
        if line.get("member") != member:
            continue
        if line["event"] == "partitions_assigned":
            added = added or bool(owned and line["partitions"])
            owned |= set(line["partitions"])
        elif line["event"] in ("partitions_revoked", "partitions_lost"):
            owned -= set(line["partitions"])
            kept = kept or bool(owned)
    return kept, added


def test_a_cooperative_sticky_group_joined_left_and_killed_mid_stream_applies_every_event_once(
        sdk_db: str, broker: Any, topic_name: Callable[[str], str],
        run_consumer: Callable[..., ConsumerThread], spawn: Callable[..., Proc]) -> None:
    bootstrap = broker.bootstrap
    topic = topic_name("coop")
    create_topic(bootstrap, topic, partitions=PARTITIONS)
    create_topic(bootstrap, f"{topic}.dlq", partitions=1)
    group = f"coop-{uuid.uuid4().hex[:8]}"  # the members' name: the inbox's dedup key and the group
    expected: set[str] = set()
    tried: set[int] = set()
    lock = threading.Lock()

    def handler_for(member: str) -> Callable[[Any, InboxMessage], None]:
        def handler(conn: Any, message: InboxMessage) -> None:
            n = message.json()["n"]
            with lock:
                first = n not in tried
                tried.add(n)
            if n % 53 == 0 and first:  # a passing failure: back-offs for the rebalances to land in
                raise RuntimeError("try again")
            time.sleep(WORK_S)  # noqa: TID251 - the handler's work takes this long
            record_effect(conn, message, consumer=member)
        return handler

    def member(label: str, **overrides: Any) -> ConsumerThread:
        config = make_config(sdk_db, broker, topic, name=group, assignment="subscribe",
                             kafka_properties=COOPERATIVE, check_retention=False,
                             retry=RetryPolicy(max_attempts=5, backoff_initial_s=0.3, backoff_max_s=0.3), **overrides)
        return run_consumer(config, handler_for(label), log=structlog.get_logger("tests.sdk").bind(member=label))

    def owns(thread: ConsumerThread) -> int:
        return len(set(thread.consumer.assigned))  # another thread's set: a copy, retried if it changed meanwhile

    def settle(count: int) -> None:
        wait_until(lambda: len(effect_counts(sdk_db)) >= count or a.error or b.error, timeout_s=120,
                   message=lambda: f"{len(effect_counts(sdk_db))} of {count} applied")
        for thread in (a, b):
            if thread.error is not None:
                raise thread.error

    with capture_logs() as logs:
        produce_chunk(bootstrap, topic, 0, expected)
        # One at a time with prefetched messages (offsets at each poll's end), and batches of 20.
        a = member("a", batch_size=1, prefetch_records=50)
        wait_until(lambda: applied_by(sdk_db, "a") >= 60, timeout_s=60, message="member a never got going")
        b = member("b", batch_size=20)
        produce_chunk(bootstrap, topic, 1, expected)  # while b joins
        wait_until(lambda: owns(b), timeout_s=60, ignore=(RuntimeError,), message="member b never got partitions")
        produce_chunk(bootstrap, topic, 2, expected)
        wait_until(lambda: applied_by(sdk_db, "b") >= 20, timeout_s=60, message="member b applied nothing")
        c = spawn([sys.executable, str(MEMBER), "--dsn", sdk_db, "--bootstrap", bootstrap, "--topic", topic,
                   "--name", group, "--member", "c"], env={"PYTHONPATH": str(ROOT)}, name="member-c", cwd=ROOT)
        wait_until(lambda: GIVEN.search(c.log_text()) or not c.alive, timeout_s=90,
                   message=lambda: f"member c never got partitions; its log:\n{c.log_tail()}")
        produce_chunk(bootstrap, topic, 3, expected)
        wait_until(lambda: applied_by(sdk_db, "c") >= 20 or not c.alive, timeout_s=60,
                   message=lambda: f"member c applied nothing; its log:\n{c.log_tail()}")
        assert c.alive, c.log_tail()
        c.sigkill()  # no leave: its partitions move once its session times out
        produce_chunk(bootstrap, topic, 4, expected)
        settle(len(expected))
        a.stop()  # leaves the group: its partitions are revoked (offsets committed) and move to b
        produce_chunk(bootstrap, topic, CHUNKS - 1, expected)  # after the last rebalance: none may stay paused
        settle(len(expected))
        wait_until(lambda: owns(b) == PARTITIONS, timeout_s=60, ignore=(RuntimeError,),
                   message=lambda: f"b owns {b.consumer.assigned}")
        # The end of each partition: what was produced to it (no transaction markers), not
        # the high watermark, which tansu reports behind the log.
        ends = {p: CHUNKS * PER_PARTITION for p in range(PARTITIONS)}
        wait_until(lambda: committed_offsets(bootstrap, group, topic) == ends, timeout_s=60,
                   message=lambda: f"committed {committed_offsets(bootstrap, group, topic)}, end {ends}")
        b.stop()

    effects = effect_counts(sdk_db)
    assert set(effects) == expected, f"{len(expected - set(effects))} events never applied"
    assert set(effects.values()) == {1}, "an event applied more than once"
    with psycopg.connect(sdk_db, autocommit=True) as conn:
        inbox = conn.execute("SELECT count(*) FROM outbox_inbox WHERE consumer = %s", (group,)).fetchone()
    assert inbox == (len(expected),)
    assert committed_offsets(bootstrap, group, topic) == ends  # b's close committed nothing stale
    assert all(applied_by(sdk_db, m) > 0 for m in "abc")
    a_kept, _ = ownership(logs, "a")
    _, b_added = ownership(logs, "b")
    assert a_kept, "member a kept no partition through a rebalance: it was not incremental"
    assert b_added, "member b was never given partitions on top of its own: it was not incremental"
    assert a.sample("outbox_consumer_rebalances_total", consumer=group, kind="revoke") >= 1
