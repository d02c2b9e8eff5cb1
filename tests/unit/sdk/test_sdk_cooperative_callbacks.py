"""Incremental rebalances (``partition.assignment.strategy=cooperative-sticky``, or
``group.protocol=consumer``) against the scripted fake Kafka client of the consumer-loop
tests: the callbacks get the partitions that change only, at every rebalance of the group
(an assign callback, perhaps empty, comes to every member).  What the batch in hand does
then: it goes on unless a partition it holds records of was taken away, and records of a
revoked partition are never applied or committed after its revoke."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from consumer_sdk import InboxMessage, RetryPolicy
from consumer_sdk import kafka as kafka_seam
from tests.unit.sdk.test_sdk_consumer_loop import TOPIC, FakeKafka, FakeMessage, build, records


class IncrementalKafka(FakeKafka):
    """The fake client, plus incremental assigns and rebalance callbacks run inside consume()."""

    def __init__(self, journal: list[Any]) -> None:
        super().__init__(journal)
        self.on_consume: list[Callable[[], Any]] = []

    def consume(self, num_messages: int, timeout: float) -> list[FakeMessage]:
        # As librdkafka may: the messages gathered first, then a rebalance callback served
        # in the same call, and the messages returned all the same.
        taken = super().consume(num_messages, timeout)
        while self.on_consume:
            self.on_consume.pop(0)()
        return taken

    def assign_more(self, *partitions: int) -> None:
        """An incremental assign of ``partitions`` (none: the empty one of a rebalance that
        moved nothing to this member)."""
        self.assigned |= {(TOPIC, p) for p in partitions}
        self.callbacks[0](self, [TopicPartition(TOPIC, p) for p in partitions])


@pytest.fixture
def journal() -> list[Any]:
    return []


@pytest.fixture
def kafka(journal: list[Any], monkeypatch: pytest.MonkeyPatch) -> IncrementalKafka:
    fake = IncrementalKafka(journal)
    monkeypatch.setattr(kafka_seam, "build_consumer", lambda config: fake)
    return fake


def commits(journal: list[Any]) -> list[dict[tuple[str, int], int]]:
    return [e[1] for e in journal if isinstance(e, tuple) and e[0] == "commit"]


def seeks(journal: list[Any]) -> list[tuple[str, int, int]]:
    return [e[1] for e in journal if isinstance(e, tuple) and e[0] == "seek"]


def failing_once(at: tuple[int, int], applied: list[tuple[int, int]]) -> Callable[[Any, InboxMessage], None]:
    """A handler recording what it applied, failing once at (partition, offset): a back-off."""
    failed: set[tuple[int, int]] = set()

    def handler(conn: Any, message: InboxMessage) -> None:
        key = (message.partition, message.offset)
        if key == at and key not in failed:
            failed.add(key)
            raise RuntimeError("slow dependency")
        applied.append(key)
    return handler


SHORT_RETRY = RetryPolicy(max_attempts=3, backoff_initial_s=0.05, backoff_max_s=0.05)


@pytest.mark.parametrize("added", [(), (2,)], ids=["empty", "new-partition"])
def test_an_incremental_assign_during_a_back_off_leaves_the_batch_running(journal, kafka, added):
    kafka.queue = records(0, 1, 2, 3)
    applied: list[tuple[int, int]] = []
    consumer = build(journal, failing_once((0, 1), applied), retry=SHORT_RETRY)
    kafka.on_poll.append(lambda: kafka.assign_more(*added))
    result = consumer.run_once()
    assert applied == [(0, 0), (0, 1), (0, 2), (0, 3)] and result.applied == 4
    assert seeks(journal) == []  # nothing abandoned, nothing fetched again
    assert consumer.offsets.applied == {(TOPIC, 0): 4}
    assert consumer.assigned == {(TOPIC, 0), (TOPIC, 1)} | {(TOPIC, p) for p in added}


def test_a_revoke_of_a_partition_the_batch_holds_nothing_of_leaves_the_batch_running(journal, kafka):
    kafka.queue = records(0, 1, 2, 3)
    applied: list[tuple[int, int]] = []
    consumer = build(journal, failing_once((0, 1), applied), retry=SHORT_RETRY)
    kafka.on_poll.append(lambda: kafka.revoke(1))
    consumer.run_once()
    assert applied == [(0, 0), (0, 1), (0, 2), (0, 3)] and seeks(journal) == []
    assert consumer.assigned == {(TOPIC, 0)} and consumer.offsets.applied == {(TOPIC, 0): 4}


def test_records_of_a_partition_revoked_inside_the_consume_call_are_neither_applied_nor_committed(journal, kafka):
    kafka.queue = records(0, 1) + records(0, 1, 2, partition=1)
    applied: list[tuple[int, int]] = []
    consumer = build(journal, lambda conn, message: applied.append((message.partition, message.offset)))
    kafka.on_consume.append(lambda: kafka.revoke(1))
    consumer.run_once()
    assert applied == [(0, 0), (0, 1)]
    assert commits(journal) == [{(TOPIC, 0): 2}]  # never an offset of partition 1, now another member's
    assert consumer.offsets.applied == {(TOPIC, 0): 2}


def test_a_revoke_commits_the_revoked_partitions_applied_offsets_only_then_forgets_them(journal, kafka):
    kafka.queue = records(0, 1) + records(0, 1, partition=1)
    kafka.fail_commits = 1  # both partitions' offsets wait, applied but not committed
    consumer = build(journal, lambda conn, message: None)
    consumer.run_once()
    assert commits(journal) == [] and consumer.offsets.applied == {(TOPIC, 0): 2, (TOPIC, 1): 2}
    kafka.queue = records(2, 3)
    kafka.on_consume.append(lambda: kafka.revoke(1))
    consumer.run_once()
    # At the revoke, partition 1's offset alone; partition 0's goes with its next batch.
    assert commits(journal) == [{(TOPIC, 1): 2}, {(TOPIC, 0): 4}]
    assert consumer.offsets.applied == {(TOPIC, 0): 4} and consumer.assigned == {(TOPIC, 0)}
