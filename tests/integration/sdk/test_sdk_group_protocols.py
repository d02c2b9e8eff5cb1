"""Both group protocols on Apache Kafka: a second member joins mid-stream while the first is
in a back-off, and every effect happens exactly once, nothing skipped.

The classic protocol revokes every partition on a rebalance; the consumer protocol (KIP-848,
``group.protocol=consumer``, Kafka 4.x) revokes only the moved ones, so the member keeps the
others with fetch positions past the batch it abandoned: the SDK must seek them back.
tansu does not support KIP-848, hence Apache Kafka only (cooperative-sticky, the classic
protocol's incremental assignment, runs on both: tests/integration/sdk/test_sdk_cooperative_rebalance.py).
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from consumer_sdk import InboxMessage, RetryPolicy
from tests.fixtures.broker import create_topic
from tests.integration.sdk._support import (
    FAST_GROUP,
    ConsumerThread,
    effect_counts,
    make_config,
    produce_raw,
    record_effect,
    wait_for,
)

N_PER_PARTITION = 60
PARTITIONS = 4


@pytest.mark.parametrize("protocol", ["classic", "consumer"])
def test_a_member_joining_mid_stream_leaves_every_effect_exactly_once(
        sdk_db: str, kafka_broker: Any, topic_name: Callable[[str], str],
        run_consumer: Callable[..., ConsumerThread], protocol: str) -> None:
    topic = topic_name(f"proto-{protocol}")
    create_topic(kafka_broker.bootstrap, topic, partitions=PARTITIONS)
    create_topic(kafka_broker.bootstrap, f"{topic}.dlq", partitions=1)
    expected: set[str] = set()
    for p in range(PARTITIONS):
        batch = []
        for i in range(N_PER_PARTITION):
            event_id = str(uuid.uuid4())
            expected.add(event_id)
            batch.append((f"k{p}".encode(), json.dumps({"n": p * 1000 + i}).encode(),
                          [("event_id", event_id.encode())]))
        produce_raw(kafka_broker.bootstrap, topic, batch, partition=p)

    attempts: Counter[str] = Counter()

    def handler(conn: Any, message: InboxMessage) -> None:
        key = str(message.event_id)
        attempts[key] += 1
        record_effect(conn, message)
        if message.offset % 9 == 4 and attempts[key] == 1:  # back-offs: rebalances land in them
            raise RuntimeError("passing failure")

    group = f"g-{uuid.uuid4().hex[:8]}"
    props: dict[str, Any] = {k: v for k, v in FAST_GROUP.items()
                             if protocol == "classic" or k not in ("session.timeout.ms", "heartbeat.interval.ms")}
    props["group.protocol"] = protocol

    def config() -> Any:
        return make_config(sdk_db, kafka_broker, topic, name=group, assignment="subscribe", batch_size=25,
                           kafka_properties=props,
                           retry=RetryPolicy(max_attempts=5, backoff_initial_s=0.4, backoff_max_s=0.4))

    first = run_consumer(config(), handler)
    wait_for(lambda: len(effect_counts(sdk_db)) >= 30 or first.error is not None, timeout_s=60,
             message="the first member applied nothing")
    second = run_consumer(config(), handler)
    wait_for(lambda: len(effect_counts(sdk_db)) >= len(expected) or first.error or second.error,
             timeout_s=120, message=lambda: f"{len(effect_counts(sdk_db))} of {len(expected)} applied")
    first.stop()
    second.stop()
    effects = effect_counts(sdk_db)
    assert set(effects) == expected
    assert set(effects.values()) == {1}
    revokes = sum(t.sample("outbox_consumer_rebalances_total", consumer=group, kind="revoke")
                  for t in (first, second))
    assert revokes >= 1, "no rebalance happened mid-stream"
