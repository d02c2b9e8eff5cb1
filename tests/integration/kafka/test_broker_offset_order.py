"""What the relay's replicas rely on from the broker: several producers writing one partition
at once never make a reader at the head of the log skip records.

Several relay replicas produce to the same partitions (shards are not partitions), and a
consumer group that received offset n + k right after n never goes back for the records
between: a topic written without transactions has no holes, so a jump means the broker
made later offsets readable before earlier ones.  Apache Kafka keeps that order.  tansu
0.6.0 (the light broker of `make demo` and of most tests) does not: with several producers
on a partition a reader at the head jumps over whole batches, which a full read finds
later at those offsets, and its high watermark trails the log.  That is the test marked
expected to fail on tansu (not strict: a run may not hit the race); the chaos soak's
consumers log such jumps (``soak_offset_jump``) when an event goes unapplied on tansu.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from outbox_embedded.broker import TansuBroker, create_topic

PRODUCERS = 4
SECONDS = 20.0


def test_several_producers_on_one_partition_never_make_a_live_reader_skip(broker: Any, topic_name: Any,
                                                                         request: pytest.FixtureRequest) -> None:
    if isinstance(broker, TansuBroker):  # runs all the same: an XPASS says a run missed the race
        request.applymarker(pytest.mark.xfail(
            strict=False, reason="tansu 0.6.0 makes later offsets readable first with several "
                                 "producers on a partition (see the module)"))
    topic = topic_name("order")
    create_topic(broker.bootstrap, topic, partitions=1)
    stop = threading.Event()
    sent = [0] * PRODUCERS
    seen: list[int] = []

    def produce(i: int) -> None:
        producer = Producer({"bootstrap.servers": broker.bootstrap, "acks": "all",
                             "enable.idempotence": True, "linger.ms": 1})
        while not stop.is_set():
            for _ in range(50):
                producer.produce(topic, value=b"x" * 200, key=b"k%d" % i)
                sent[i] += 1
            producer.poll(0)
            stop.wait(0.002)
        assert producer.flush(30) == 0

    def read() -> None:
        consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": f"order-{uuid.uuid4().hex[:6]}",
                             "enable.auto.commit": False, "fetch.wait.max.ms": 5})
        consumer.assign([TopicPartition(topic, 0, 0)])
        try:
            deadline = None
            while deadline is None or time.monotonic() < deadline:
                if deadline is None and stop.is_set():
                    deadline = time.monotonic() + 30
                for msg in consumer.consume(500, 0.05):
                    if msg.error() is None:
                        seen.append(msg.offset())
                if stop.is_set() and len(seen) >= sum(sent):
                    return
        finally:
            consumer.close()

    threads = [threading.Thread(target=produce, args=(i,)) for i in range(PRODUCERS)]
    threads.append(threading.Thread(target=read))
    for thread in threads:
        thread.start()
    stop.wait(SECONDS)
    stop.set()
    for thread in threads:
        thread.join(60)
    jumps = [(a, b) for a, b in zip(seen, seen[1:], strict=False) if b != a + 1]
    assert sum(sent) > 10_000, sent  # the producers did run side by side
    assert jumps == [], f"the reader jumped {len(jumps)} times, first {jumps[:5]}"
    assert seen == list(range(sum(sent)))  # every record, in offset order, nothing beyond
