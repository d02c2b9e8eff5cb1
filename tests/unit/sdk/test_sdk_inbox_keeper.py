"""The keeper that polls Kafka beside a long transaction (:mod:`consumer_sdk.inbox_keeper`):
its hand-over with the batch loop, and, against the scripted fake client of the consumer-loop
tests, a rebalance it serves while a handler runs (no sockets).

Before it, nothing polled inside a transaction: one longer than ``max.poll.interval.ms``
made the member leave its group (tests/integration/sdk/test_sdk_long_transactions.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import structlog

from consumer_sdk import InboxConfig, InboxConsumer, InboxMessage
from consumer_sdk import kafka as kafka_seam
from consumer_sdk.inbox_keeper import KafkaKeeper
from consumer_sdk.metrics import ConsumerMetrics
from consumer_sdk.testing import FakeDeadLetters
from tests.unit.sdk.test_sdk_consumer_loop import TOPIC, FakeKafka, JournalStore, records

WAIT_S = 10.0  # a condition the code signals; only a failing test waits this long


class Keeping:
    """A ``keep`` that records its sessions and whether the loop ever used the consumer
    while one ran."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.sessions: list[str] = []
        self.overlaps = 0

    def __call__(self, hand_back: Callable[[], bool]) -> bool:
        self.sessions.append(threading.current_thread().name)
        self.inside.set()
        try:
            while not hand_back():
                threading.Event().wait(0.001)
        finally:
            self.inside.clear()
        return False  # handed back, not given up

    def used_by_the_loop(self) -> None:
        if self.inside.is_set():
            self.overlaps += 1


def keeper_with(keeping: Keeping, idle: list[float]) -> KafkaKeeper:
    return KafkaKeeper(keeping, idle_s=lambda: idle[0], after_s=1.0, log=structlog.get_logger())


def test_the_keeper_takes_the_consumer_only_while_lent_and_unpolled_and_hands_it_back():
    keeping, idle = Keeping(), [5.0]  # unpolled for longer than after_s
    keeper = keeper_with(keeping, idle)
    keeper.start()
    try:
        assert not keeping.inside.wait(1.0) and keeping.sessions == []  # not lent: never
        with keeper.lent():
            assert keeping.inside.wait(WAIT_S), "the keeper never took the lent consumer"
            with keeper.held():  # the loop takes it back: the keeper's session ends first
                keeping.used_by_the_loop()
            idle[0] = 0.0  # the keeper polled (as _keep_beside records)
            with keeper.held():
                keeping.used_by_the_loop()
        assert not keeping.inside.is_set()  # the loan is over: handed back
        keeping.used_by_the_loop()
    finally:
        keeper.stop()
    assert keeping.overlaps == 0
    assert keeping.sessions and set(keeping.sessions) == {KafkaKeeper.thread_name}
    keeper.stop()  # idempotent


def test_a_keeper_never_takes_a_consumer_polled_lately():
    keeping, idle = Keeping(), [0.5]  # polled half after_s ago
    keeper = keeper_with(keeping, idle)
    keeper.start()
    try:
        with keeper.lent():
            assert not keeping.inside.wait(1.5)
    finally:
        keeper.stop()
    assert keeping.sessions == []


class GivingUp(Keeping):
    """A ``keep`` that gives up at once (the transaction ran past the keeper's limit)."""

    def __call__(self, hand_back: Callable[[], bool]) -> bool:
        self.sessions.append(threading.current_thread().name)
        return True


def test_a_keeper_that_gave_up_beside_a_transaction_takes_the_consumer_again_only_at_the_next_loan():
    keeping, idle = GivingUp(), [5.0]  # unpolled for longer than after_s, and it stays so
    keeper = keeper_with(keeping, idle)
    keeper.start()
    try:
        with keeper.lent():
            wait = threading.Event()
            for _ in range(int(WAIT_S * 100)):  # the first session, then none while this loan lasts
                if keeping.sessions:
                    break
                wait.wait(0.01)
            assert keeping.sessions == [KafkaKeeper.thread_name], "the keeper never took the lent consumer"
            assert not wait.wait(1.5) and len(keeping.sessions) == 1, keeping.sessions
        with keeper.lent():  # the next batch's loan: kept again
            for _ in range(int(WAIT_S * 100)):
                if len(keeping.sessions) == 2:
                    break
                wait.wait(0.01)
            assert len(keeping.sessions) == 2, keeping.sessions
    finally:
        keeper.stop()


class ExclusiveKafka(FakeKafka):
    """The fake client, counting calls that overlap another thread's (never allowed; a
    rebalance callback's calls, inside a poll on the same thread, are librdkafka's way)."""

    def __init__(self, journal: list[Any]) -> None:
        super().__init__(journal)
        self._in_use = threading.RLock()
        self.overlaps = 0
        self.poll_threads: list[str] = []

    def _using(self, name: str) -> Callable[..., Any]:
        method = getattr(super(), name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if name == "poll":
                self.poll_threads.append(threading.current_thread().name)
            if not self._in_use.acquire(blocking=False):  # another thread is inside a call
                self.overlaps += 1
                return method(*args, **kwargs)
            try:
                if name == "poll":  # as librdkafka's, a poll blocks (the loop could meet it)
                    threading.Event().wait(min(args[0], 0.02))
                return method(*args, **kwargs)
            finally:
                self._in_use.release()
        return call

    def __getattribute__(self, name: str) -> Any:
        if name in ("consume", "poll", "commit", "assignment", "pause", "resume", "seek", "get_watermark_offsets"):
            return object.__getattribute__(self, "_using")(name)
        return object.__getattribute__(self, name)


@pytest.fixture
def journal() -> list[Any]:
    return []


@pytest.fixture
def kafka(journal: list[Any], monkeypatch: pytest.MonkeyPatch) -> ExclusiveKafka:
    fake = ExclusiveKafka(journal)
    monkeypatch.setattr(kafka_seam, "build_consumer", lambda config: fake)
    return fake


def test_a_revoke_served_beside_a_long_handler_commits_no_offset_of_the_revoked_partition(journal, kafka):
    """The handler of (0, 0) runs past the keeper's threshold (a clock moved on); the keeper
    polls, and a revoke of partition 0 comes in that poll.  The handler's transaction then
    commits: its effect stays (the inbox), but partition 0, forgotten, gets no offset from
    it, and the batch stops there (its rest is the next owner's)."""
    now = [0.0]
    config = InboxConfig(name="svc", dsn="postgresql://unused", bootstrap_servers="k:1", topics=[TOPIC],
                         assignment="subscribe", batch_size=1, check_retention=False, inbox_retention_s=None)
    revoked = threading.Event()
    applied: list[tuple[int, int]] = []
    revoked_meanwhile: list[bool] = []

    def long_handler(conn: Any, message: InboxMessage) -> None:
        if (message.partition, message.offset) == (0, 0):
            now[0] += config.max_poll_interval_s()  # a whole interval unpolled
            revoked_meanwhile.append(revoked.wait(WAIT_S))
        applied.append((message.partition, message.offset))

    def revoke() -> None:
        kafka.revoke(0)
        revoked.set()

    consumer = InboxConsumer(config, long_handler, metrics=ConsumerMetrics(), dead_letters=FakeDeadLetters(),
                             clock=lambda: now[0])
    consumer.store = JournalStore(journal)  # type: ignore[assignment]
    kafka.queue = records(0, 1, 2)
    kafka.on_poll.append(revoke)
    try:
        consumer.run_once()
    finally:
        consumer.close()
    assert revoked_meanwhile == [True], "nothing polled while the handler ran"
    assert "outbox-consumer-keeper" in kafka.poll_threads
    assert applied == [(0, 0)]  # the batch stopped after the transaction in flight
    assert [e for e in journal if isinstance(e, tuple) and e[0] == "commit"] == []
    assert consumer.offsets.applied == {} and consumer.assigned == {(TOPIC, 1)}
    assert kafka.overlaps == 0
