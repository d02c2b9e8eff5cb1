"""The processor's rules, on the in-memory fakes (no sockets): dedup, retries, dead letters,
policies, and what a failing message in a batch does to its neighbours."""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import pytest

from consumer_sdk import (
    ConsumerStopped,
    DeadLetterBlocked,
    DeadLetterFailed,
    InboxMessage,
    PermanentError,
    RetriableError,
    RetryPolicy,
)
from consumer_sdk.processor import Policies
from consumer_sdk.testing import FakeInbox, make_record


class Effects:
    """A handler that counts applications and fails on demand."""

    def __init__(self) -> None:
        self.applied: Counter[int] = Counter()
        self.calls: Counter[int] = Counter()
        self.fail: dict[int, int] = {}  # n -> failures left (-1: forever)
        self.permanent: set[int] = set()

    def __call__(self, conn: Any, message: InboxMessage) -> None:
        n = message.json()["n"]
        self.calls[n] += 1
        if n in self.permanent:
            raise PermanentError(f"bad {n}")
        if self.fail.get(n, 0):
            self.fail[n] -= 1
            raise RuntimeError(f"boom {n}")
        self.applied[n] += 1


def records(count: int, start: int = 0) -> list:
    return [make_record(value={"n": i}, offset=i) for i in range(start, start + count)]


def test_each_event_applied_once_however_often_delivered():
    effects = Effects()
    inbox = FakeInbox(effects)
    batch = records(5)
    first = inbox.deliver(*batch)
    again = inbox.deliver(*batch, *batch)
    assert (first.applied, first.duplicates) == (5, 0)
    assert (again.applied, again.duplicates, again.settled) == (0, 10, 10)
    assert set(effects.applied.values()) == {1}
    sample = inbox.metrics.registry.get_sample_value
    assert sample("outbox_consumer_duplicates_dropped_total", {"consumer": "test", "topic": "test"}) == 10


def test_a_failing_message_in_a_batch_neither_loses_nor_doubles_its_neighbours():
    effects = Effects()
    effects.fail[2] = 1  # fails once, then works
    inbox = FakeInbox(effects, retry=RetryPolicy(max_attempts=3, backoff_initial_s=0.5))
    batch = records(5)
    result = inbox.deliver(*batch)
    assert dict(effects.applied) == {i: 1 for i in range(5)}
    assert effects.calls[2] == 2 and effects.calls[1] == 1 and effects.calls[3] == 1
    assert result.handler_errors == 1 and result.applied == 5 and inbox.sleeps == [0.5]
    # Settled in order, so offsets never pass an unsettled message.
    assert [r.offset for r in inbox.settled] == [0, 1, 2, 3, 4]


def test_retries_are_capped_then_dead_lettered_with_the_error():
    effects = Effects()
    effects.fail[1] = -1
    inbox = FakeInbox(effects, retry=RetryPolicy(max_attempts=4, backoff_initial_s=0.1, backoff_max_s=0.3))
    result = inbox.deliver(*records(3))
    assert effects.calls[1] == 4 and inbox.sleeps == [0.1, 0.2, 0.3]
    [letter] = inbox.dead_letters.letters
    assert (letter.reason, letter.attempts, letter.error_type) == ("retries_exhausted", 4, "RuntimeError")
    assert letter.error == "RuntimeError: boom 1" and letter.record.offset == 1
    assert result.dead_lettered == 1 and result.settled == 3 and dict(effects.applied) == {0: 1, 2: 1}
    # The dead-lettered event left no inbox row: a redelivery is tried again, not dropped.
    effects.fail[1] = 0
    assert inbox.deliver(letter.record).applied == 1


def test_permanent_error_skips_the_retries():
    effects = Effects()
    effects.permanent.add(0)
    inbox = FakeInbox(effects)
    inbox.deliver(*records(2))
    assert effects.calls[0] == 1 and inbox.sleeps == []
    assert [(d.reason, d.attempts) for d in inbox.dead_letters.letters] == [("permanent_error", 1)]


def test_retry_forever_keeps_going():
    effects = Effects()
    effects.fail[0] = 50
    inbox = FakeInbox(effects, retry=RetryPolicy(max_attempts=None, backoff_initial_s=0.01, backoff_max_s=1))
    assert inbox.deliver(*records(1)).applied == 1
    assert effects.calls[0] == 51 and max(inbox.sleeps) == 1


def test_stop_policy_settles_what_came_before_and_raises():
    effects = Effects()
    effects.fail[2] = -1
    inbox = FakeInbox(effects, retry=RetryPolicy(max_attempts=2, then="stop"))
    with pytest.raises(ConsumerStopped) as stopped:
        inbox.deliver(*records(5))
    assert (stopped.value.reason, stopped.value.offset) == ("retries_exhausted", 2)
    assert [r.offset for r in inbox.settled] == [0, 1]
    assert dict(effects.applied) == {0: 1, 1: 1} and inbox.dead_letters.letters == []


@pytest.mark.parametrize("header", [None, "not-a-uuid", "\u00e9"])
def test_missing_or_malformed_event_ids_are_dead_lettered_by_default(header):
    effects = Effects()
    inbox = FakeInbox(effects)
    bad = make_record(value={"n": 9}, event_id=header, omit_event_id=header is None, offset=1)
    result = inbox.deliver(make_record(value={"n": 0}), bad, make_record(value={"n": 2}, offset=2))
    assert result.invalid == 1 and result.settled == 3 and dict(effects.applied) == {0: 1, 2: 1}
    [letter] = inbox.dead_letters.letters
    assert letter.reason == "invalid_event_id" and letter.attempts == 0


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_invalid_event_id_policies(policy):
    inbox = FakeInbox(Effects(), policies=Policies(on_invalid_event_id=policy))
    bad = make_record(value={"n": 1}, omit_event_id=True, offset=1)
    if policy == "stop":
        with pytest.raises(ConsumerStopped):
            inbox.deliver(make_record(value={"n": 0}), bad)
        assert [r.offset for r in inbox.settled] == [0]
    else:
        assert inbox.deliver(bad).skipped == 1
    assert inbox.dead_letters.letters == []


def test_same_event_id_with_another_body_is_a_mismatch_not_a_duplicate():
    effects = Effects()
    inbox = FakeInbox(effects)
    event_id = uuid.uuid4()
    result = inbox.deliver(make_record(value={"n": 1}, event_id=event_id),
                           make_record(value={"n": 1}, event_id=event_id, offset=1),
                           make_record(value={"n": 2}, event_id=event_id, offset=2))
    assert (result.applied, result.duplicates, result.mismatches) == (1, 1, 1)
    assert [d.reason for d in inbox.dead_letters.letters] == ["payload_mismatch"]
    assert effects.calls == Counter({1: 1})


def test_a_dead_letter_that_fails_leaves_the_message_unsettled():
    effects = Effects()
    effects.permanent.add(1)
    inbox = FakeInbox(effects)
    inbox.dead_letters.fail = DeadLetterFailed("broker down")
    with pytest.raises(DeadLetterBlocked) as blocked:
        inbox.deliver(*records(3))
    assert [r.offset for r in inbox.settled] == [0]  # the batch before it committed; 1 and 2 did not
    assert not isinstance(blocked.value, RetriableError)  # a retry of the batch would re-run the handler
    assert blocked.value.offset == 1 and blocked.value.letter.reason == "permanent_error"
    assert inbox.metrics.registry.get_sample_value(
        "outbox_consumer_dead_letter_failures_total", {"consumer": "test", "topic": "test"}) == 1


def test_a_handler_exception_rolls_back_its_inbox_row():
    effects = Effects()
    effects.fail[0] = -1
    inbox = FakeInbox(effects, retry=RetryPolicy(max_attempts=1))
    inbox.deliver(*records(1))
    assert inbox.store.rows == {}
