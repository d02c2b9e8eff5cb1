"""The consumer loop's offset and rebalance rules, against a scripted fake Kafka client and
the in-memory inbox (no sockets): offsets follow database commits, a rebalance or a stop
during a back-off abandons the rest of the batch, failed commits are retried."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from consumer_sdk import (
    DatabaseUnavailable,
    DeadLetterFailed,
    InboxConfig,
    InboxConsumer,
    InboxMessage,
    PermanentError,
    RetryPolicy,
)
from consumer_sdk import kafka as kafka_seam
from consumer_sdk.metrics import ConsumerMetrics
from consumer_sdk.model import DeadLetter, KafkaRecord
from consumer_sdk.testing import FakeDeadLetters, FakeInboxStore, make_record

TOPIC = "orders"


class FakeMessage:
    def __init__(self, record: KafkaRecord) -> None:
        self.r = record

    def error(self) -> None:
        return None

    def topic(self) -> str:
        return self.r.topic

    def partition(self) -> int:
        return self.r.partition

    def offset(self) -> int:
        return self.r.offset

    def key(self) -> bytes | None:
        return self.r.key

    def value(self) -> bytes | None:
        return self.r.value

    def headers(self) -> list[tuple[str, bytes | None]]:
        return list(self.r.headers)


class FakeKafka:
    """Enough of confluent_kafka.Consumer: a queue, a journal, scripted poll() hooks."""

    def __init__(self, journal: list[Any]) -> None:
        self.journal = journal
        self.queue: list[KafkaRecord] = []
        self.assigned: set[tuple[str, int]] = set()
        self.callbacks: tuple[Callable[..., None], ...] = ()
        self.on_poll: list[Callable[[], Any]] = []
        self.fail_commits = 0

    def subscribe(self, topics: list[str], on_assign: Any, on_revoke: Any, on_lost: Any) -> None:
        self.callbacks = (on_assign, on_revoke, on_lost)
        self.assigned = {(TOPIC, 0), (TOPIC, 1)}
        on_assign(self, self.assignment())

    def consume(self, num_messages: int, timeout: float) -> list[FakeMessage]:
        taken, self.queue = self.queue[:num_messages], self.queue[num_messages:]
        return [FakeMessage(r) for r in taken]

    def poll(self, timeout: float) -> FakeMessage | None:
        self.journal.append("poll")
        return self.on_poll.pop(0)() if self.on_poll else None

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> list[TopicPartition]:
        assert asynchronous is False
        if self.fail_commits:
            self.fail_commits -= 1
            raise KafkaException(KafkaError(KafkaError.REBALANCE_IN_PROGRESS))
        self.journal.append(("commit", {(tp.topic, tp.partition): tp.offset for tp in offsets}))
        return [TopicPartition(tp.topic, tp.partition, tp.offset) for tp in offsets]

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition(t, p) for t, p in sorted(self.assigned)]

    def pause(self, parts: list[TopicPartition]) -> None:
        self.journal.append("pause")

    def resume(self, parts: list[TopicPartition]) -> None:
        self.journal.append("resume")

    def seek(self, tp: TopicPartition) -> None:
        self.journal.append(("seek", (tp.topic, tp.partition, tp.offset)))

    def get_watermark_offsets(self, tp: TopicPartition, cached: bool) -> tuple[int, int]:
        return 0, 10

    def revoke(self, *partitions: int) -> None:
        parts = [TopicPartition(TOPIC, p) for p in partitions]
        self.callbacks[1](self, parts)
        self.assigned -= {(TOPIC, p) for p in partitions}

    def close(self) -> None:
        self.journal.append("close")


class JournalStore(FakeInboxStore):
    """The fake inbox, plus the PgInboxStore extras the loop calls, journaling commits."""

    session = None  # no backend: the lock-wait watch has nothing to look at

    def __init__(self, journal: list[Any]) -> None:
        super().__init__()
        self.journal = journal
        self.fail_transactions = 0

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        if self.fail_transactions:
            self.fail_transactions -= 1
            raise DatabaseUnavailable("down")
        with super().transaction() as conn:
            yield conn
        self.journal.append("db_commit")

    def check_schema(self) -> None: ...

    def bind_group(self, **_: Any) -> None: ...

    def reset(self) -> None: ...

    close = reset

    def cleanup_batch(self, **_: Any) -> int:
        return 0


@pytest.fixture
def journal() -> list[Any]:
    return []


@pytest.fixture
def kafka(journal: list[Any], monkeypatch: pytest.MonkeyPatch) -> FakeKafka:
    fake = FakeKafka(journal)
    monkeypatch.setattr(kafka_seam, "build_consumer", lambda config: fake)
    return fake


def build(journal: list[Any], handler: Any, **overrides: Any) -> InboxConsumer:
    values: dict[str, Any] = {"name": "svc", "dsn": "postgresql://unused", "bootstrap_servers": "k:1",
                              "topics": [TOPIC], "batch_size": 10, "check_retention": False,
                              "inbox_retention_s": None,
                              "retry": RetryPolicy(max_attempts=3, backoff_initial_s=0.01, backoff_max_s=0.01)}
    values.update(overrides)
    consumer = InboxConsumer(InboxConfig(**values), handler, metrics=ConsumerMetrics(),
                             dead_letters=FakeDeadLetters())
    consumer.store = JournalStore(journal)  # type: ignore[assignment]
    return consumer


def records(*offsets: int, partition: int = 0) -> list[KafkaRecord]:
    return [make_record(topic=TOPIC, partition=partition, offset=o, value={"n": o}) for o in offsets]


def test_offsets_are_committed_after_the_database_commit(journal, kafka):
    kafka.queue = records(0, 1, 2) + records(0, 1, partition=1)
    consumer = build(journal, lambda conn, message: None)
    assert consumer.run_once().applied == 5
    events = [e for e in journal if e not in ("poll",)]
    assert events == ["db_commit", ("commit", {(TOPIC, 0): 3, (TOPIC, 1): 2})]
    consumer.close()
    assert journal[-1] == "close"


def test_a_handler_failure_commits_the_prefix_before_retrying(journal, kafka):
    kafka.queue = records(0, 1, 2, 3)
    calls: list[int] = []

    def handler(conn: Any, message: InboxMessage) -> None:
        calls.append(message.offset)
        if message.offset == 2 and calls.count(2) == 1:
            raise RuntimeError("once")

    consumer = build(journal, handler)
    assert consumer.run_once().applied == 4
    commits = [e[1] for e in journal if isinstance(e, tuple)]
    assert commits == [{(TOPIC, 0): 2}, {(TOPIC, 0): 3}, {(TOPIC, 0): 4}]
    assert "pause" in journal and journal.index("pause") < journal.index("resume")  # back-off kept polling


def test_a_rebalance_during_the_backoff_abandons_the_rest_of_the_batch(journal, kafka):
    kafka.queue = records(0, 1, 2, 3, 4)
    applied: list[int] = []

    def handler(conn: Any, message: InboxMessage) -> None:
        if message.offset == 2:
            raise RuntimeError("slow dependency")
        applied.append(message.offset)

    consumer = build(journal, handler, retry=RetryPolicy(max_attempts=3, backoff_initial_s=5, backoff_max_s=5))
    kafka.on_poll.append(lambda: kafka.revoke(0, 1))
    result = consumer.run_once()
    assert applied == [0, 1] and result.applied == 2
    assert consumer.offsets.applied == {} and consumer.assigned == set()
    assert [e[1] for e in journal if isinstance(e, tuple)] == [{(TOPIC, 0): 2}]  # nothing past the failure
    assert consumer.metrics.registry.get_sample_value(
        "outbox_consumer_rebalances_total", {"consumer": "svc", "kind": "revoke"}) == 1


def test_stop_during_the_backoff_abandons_without_committing_past_the_failure(journal, kafka):
    kafka.queue = records(0, 1, 2)
    consumer = build(journal, lambda conn, message: (_ for _ in ()).throw(RuntimeError("x")),
                     retry=RetryPolicy(max_attempts=None, backoff_initial_s=5, backoff_max_s=5))
    kafka.on_poll.append(consumer.stop)
    result = consumer.run_once()
    assert result.settled == 0 and not any(isinstance(e, tuple) for e in journal)


def test_a_failed_offset_commit_is_carried_into_the_next_one(journal, kafka):
    kafka.queue = records(0, 1, 2)
    kafka.fail_commits = 1
    consumer = build(journal, lambda conn, message: None, batch_size=2)
    consumer.run_once()
    assert not any(isinstance(e, tuple) for e in journal)
    consumer.run_once()
    assert [e[1] for e in journal if isinstance(e, tuple)] == [{(TOPIC, 0): 3}]
    assert consumer.metrics.registry.get_sample_value(
        "outbox_consumer_offset_commit_failures_total", {"consumer": "svc"}) == 1


def test_a_message_returned_while_paused_is_kept_for_the_next_batch(journal, kafka):
    kafka.queue = records(0)
    late = records(1)[0]
    applied: list[int] = []

    def handler(conn: Any, message: InboxMessage) -> None:
        if message.offset == 0 and not applied:
            applied.append(-1)
            raise RuntimeError("once")
        applied.append(message.offset)

    consumer = build(journal, handler)
    kafka.on_poll.append(lambda: FakeMessage(late))
    consumer.run_once()
    consumer.run_once()
    assert applied == [-1, 0, 1]


def test_a_database_outage_retries_only_the_unsettled_messages(journal, kafka):
    kafka.queue = records(0, 1, 2)
    applied: list[int] = []
    consumer = build(journal, lambda conn, message: applied.append(message.offset), db_backoff_initial_s=0.01,
                     db_backoff_max_s=0.01)
    consumer.store.fail_transactions = 2  # type: ignore[attr-defined]
    result = consumer.run_once()
    assert applied == [0, 1, 2] and result.applied == 3
    assert consumer.metrics.registry.get_sample_value(
        "outbox_consumer_database_errors_total", {"consumer": "svc"}) == 2


class FlakyDeadLetters(FakeDeadLetters):
    """Refuses the first ``failures`` letters (a too-large record, a missing topic, an ACL)."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def send(self, letter: DeadLetter) -> None:
        if self.failures:
            self.failures -= 1
            raise DeadLetterFailed("Broker: Message size too large")
        super().send(letter)


def test_a_dead_letter_that_cannot_be_produced_pauses_its_partition_and_never_reruns_the_handler(journal, kafka):
    kafka.queue = records(0, 1, 2) + records(0, 1, partition=1)
    calls: list[tuple[int, int]] = []

    def handler(conn: Any, message: InboxMessage) -> None:
        calls.append((message.partition, message.offset))
        if (message.partition, message.offset) == (0, 1):
            raise PermanentError("cannot ever apply")

    sink = FlakyDeadLetters(failures=3)
    consumer = build(journal, handler, db_backoff_initial_s=0.001, db_backoff_max_s=0.001)
    consumer._dead_letters = sink  # noqa: SLF001 - the loop takes its sink at start()
    first = consumer.run_once()
    assert first.applied == 3  # p0@0 and both of p1: the other partition keeps flowing
    assert ("seek", (TOPIC, 0, 2)) in journal and "pause" in journal  # parked right after the record
    assert consumer.offsets.applied == {(TOPIC, 0): 1, (TOPIC, 1): 2}  # nothing past the letter
    deadline = time.monotonic() + 10
    while consumer.parked and time.monotonic() < deadline:
        consumer.run_once()
    assert not consumer.parked and len(sink.letters) == 1
    assert calls.count((0, 1)) == 1  # the handler ran once; only the sending was retried
    assert consumer.offsets.applied[(TOPIC, 0)] == 2 and journal[-1] == "resume"
    sample = consumer.metrics.registry.get_sample_value
    assert sample("outbox_consumer_dead_letter_failures_total", {"consumer": "svc", "topic": TOPIC}) == 3
    assert not sample("outbox_consumer_database_errors_total", {"consumer": "svc"})
    assert sample("outbox_consumer_dead_letter_blocked_partitions", {"consumer": "svc"}) == 0


def test_an_incremental_rebalance_rewinds_the_kept_partitions_past_an_abandoned_batch(journal, kafka):
    """group.protocol=consumer (KIP-848) revokes only some partitions: the kept ones keep their
    fetch position, which is past the abandoned records; without a seek they would be skipped."""
    kafka.queue = records(0, 1, 2, 3, 4) + records(0, 1, 2, partition=1)
    applied: list[tuple[int, int]] = []

    def handler(conn: Any, message: InboxMessage) -> None:
        if (message.partition, message.offset) == (0, 2) and (0, -2) not in applied:
            applied.append((0, -2))
            raise RuntimeError("slow dependency")
        applied.append((message.partition, message.offset))

    consumer = build(journal, handler, retry=RetryPolicy(max_attempts=3, backoff_initial_s=5, backoff_max_s=5))
    kafka.on_poll.append(lambda: kafka.revoke(1))  # partition 0 is kept
    consumer.run_once()
    assert consumer.assigned == {(TOPIC, 0)} and consumer.offsets.applied == {(TOPIC, 0): 2}
    assert ("seek", (TOPIC, 0, 2)) in journal  # the kept partition starts again at the abandoned record
    assert not any(e[0] == "seek" and e[1][1] == 1 for e in journal if isinstance(e, tuple))
