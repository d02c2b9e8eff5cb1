"""Issue 19: with a store whose transaction rolls the handler's writes back (PostgreSQL), a
batch sets no savepoint per message.  A handler failure rolls the whole transaction back;
the records before the failing one are applied again in a transaction of their own, the
failure counts once, as the failing record's first attempt, and what was dead-lettered or
skipped before it is not sent or counted twice."""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

from consumer_sdk import InboxMessage, RetryPolicy
from consumer_sdk.processor import Policies
from consumer_sdk.testing import FakeInbox, FakeInboxStore, make_record


class Handler:
    def __init__(self, fail: dict[int, int] | None = None) -> None:
        self.calls: Counter[int] = Counter()
        self.fail = dict(fail or {})  # n -> failures left (-1: forever)

    def __call__(self, conn: Any, message: InboxMessage) -> None:
        n = message.json()["n"]
        self.calls[n] += 1
        if self.fail.get(n, 0):
            self.fail[n] -= 1
            raise RuntimeError(f"boom {n}")


class CountingStore(FakeInboxStore):
    """Counts savepoints (``attempt()``) and transactions."""

    def __init__(self) -> None:
        super().__init__(handler_writes_roll_back=True)
        self.savepoints = 0
        self.transactions = 0

    def attempt(self) -> Any:
        self.savepoints += 1
        return super().attempt()

    def transaction(self) -> Any:
        self.transactions += 1
        return super().transaction()


def records(count: int) -> list:
    return [make_record(value={"n": i}, offset=i) for i in range(count)]


def inbox_with(handler: Handler, **kwargs: Any) -> tuple[FakeInbox, CountingStore]:
    inbox = FakeInbox(handler, handler_writes_roll_back=True, **kwargs)
    store = CountingStore()
    inbox.store = store
    inbox.processor._store = store  # the fake's processor over the counting store
    return inbox, store


def test_a_batch_that_goes_well_sets_no_savepoint():
    handler = Handler()
    inbox, store = inbox_with(handler)
    result = inbox.deliver(*records(50))
    assert result.applied == 50 and store.savepoints == 0 and store.transactions == 1
    assert set(handler.calls.values()) == {1}


def test_a_failure_reruns_the_records_before_it_and_counts_once():
    handler = Handler(fail={2: 1})
    inbox, store = inbox_with(handler, retry=RetryPolicy(max_attempts=3, backoff_initial_s=0.5))
    result = inbox.deliver(*records(5))
    # 0 and 1: their first run rolled back with the failure, then applied again; 2: failed once,
    # then retried alone after the back-off; 3 and 4: once, after it.
    assert dict(handler.calls) == {0: 2, 1: 2, 2: 2, 3: 1, 4: 1}
    assert (result.applied, result.handler_errors, result.settled) == (5, 1, 5)
    assert inbox.sleeps == [0.5] and [r.offset for r in inbox.settled] == [0, 1, 2, 3, 4]
    assert store.savepoints == 0
    assert len(store.rows) == 5  # one inbox row each: the rolled-back claims left nothing behind


def test_a_failing_first_record_reruns_nothing_and_exhausts_its_attempts():
    handler = Handler(fail={0: -1})
    inbox, _ = inbox_with(handler, retry=RetryPolicy(max_attempts=3, backoff_initial_s=0.1))
    result = inbox.deliver(*records(3))
    assert dict(handler.calls) == {0: 3, 1: 1, 2: 1}
    [letter] = inbox.dead_letters.letters
    assert (letter.reason, letter.attempts, letter.record.offset) == ("retries_exhausted", 3, 0)
    assert (result.applied, result.dead_lettered, result.handler_errors) == (2, 1, 3)


def test_a_dead_letter_before_the_failure_is_sent_once():
    handler = Handler(fail={2: 1})
    inbox, _ = inbox_with(handler, policies=Policies(retry=RetryPolicy(max_attempts=3, backoff_initial_s=0.1)))
    reused = uuid.uuid4()
    inbox.deliver(make_record(value={"n": 10}, event_id=reused))
    batch = [make_record(value={"n": 0}, offset=0),
             make_record(value={"n": 1}, offset=1, event_id=reused),  # same event id, another body
             make_record(value={"n": 2}, offset=2)]
    result = inbox.deliver(*batch)
    assert [d.reason for d in inbox.dead_letters.letters] == ["payload_mismatch"]
    assert (result.mismatches, result.dead_lettered, result.applied, result.settled) == (1, 1, 2, 3)
    assert handler.calls[0] == 2 and handler.calls[2] == 2 and handler.calls[1] == 0
    sample = inbox.metrics.registry.get_sample_value
    assert sample("outbox_consumer_payload_mismatches_total", {"consumer": "test", "topic": "test"}) == 1


def test_savepoint_per_message_keeps_each_successful_handler_to_one_run():
    import structlog

    from consumer_sdk.metrics import ConsumerMetrics
    from consumer_sdk.processor import Processor
    from consumer_sdk.testing import FakeDeadLetters

    handler = Handler(fail={2: 1})
    store = CountingStore()
    settled: list = []
    processor = Processor(consumer="test", store=store, handler=handler, dead_letters=FakeDeadLetters(),
                          policies=Policies(retry=RetryPolicy(max_attempts=3, backoff_initial_s=0.1)),
                          metrics=ConsumerMetrics(), log=structlog.get_logger("tests"), sleep=lambda s: None,
                          on_settled=settled.extend, savepoint_per_message=True)
    result = processor.process(records(5))
    assert dict(handler.calls) == {0: 1, 1: 1, 2: 2, 3: 1, 4: 1}
    assert (result.applied, result.handler_errors) == (5, 1) and store.savepoints >= 5
