"""A batch's inbox rows are claimed in one statement; the handlers still run once each in a
savepoint of their own, and a failure leaves no row claimed for a record not applied.  And
the batch handler: one call for the batch's new messages, one by one when it fails.  On the
in-memory fakes (no sockets)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from consumer_sdk import InboxMessage, RetryPolicy
from consumer_sdk.testing import FakeInbox, make_record


def records(count: int, start: int = 0) -> list:
    return [make_record(value={"n": i}, offset=i) for i in range(start, start + count)]


class Calls:
    def __init__(self, fail: dict[int, int] | None = None) -> None:
        self.calls: list[int] = []
        self.fail = dict(fail or {})  # n -> failures left (-1: forever)

    def __call__(self, conn: Any, message: InboxMessage) -> None:
        n = message.json()["n"]
        self.calls.append(n)
        if self.fail.get(n, 0):
            self.fail[n] -= 1
            raise RuntimeError(f"boom {n}")


def counting(inbox: FakeInbox) -> list[str]:
    """Journal of the store calls a batch makes."""
    journal: list[str] = []
    store = inbox.store
    for name in ("claim", "claim_many", "unclaim"):
        original = getattr(store, name)

        def wrapped(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            journal.append(_name)
            return _original(*args, **kwargs)

        setattr(store, name, wrapped)
    return journal


def test_one_claim_statement_per_batch_and_duplicates_cost_no_handler_call():
    calls = Calls()
    inbox = FakeInbox(calls)
    journal = counting(inbox)
    batch = records(5)
    assert inbox.deliver(*batch).applied == 5
    assert inbox.deliver(*batch).duplicates == 5
    assert journal == ["claim_many", "claim_many"] and calls.calls == [0, 1, 2, 3, 4]


def test_a_failure_commits_the_prefix_unclaims_the_rest_and_reruns_nothing():
    calls = Calls(fail={2: 1})
    inbox = FakeInbox(calls, retry=RetryPolicy(max_attempts=3, backoff_initial_s=0.5))
    journal = counting(inbox)
    result = inbox.deliver(*records(5))
    assert calls.calls == [0, 1, 2, 2, 3, 4]  # no neighbour ran twice
    assert result.applied == 5 and result.handler_errors == 1 and inbox.sleeps == [0.5]
    assert [r.offset for r in inbox.settled] == [0, 1, 2, 3, 4]
    assert journal[:2] == ["claim_many", "unclaim"] and len(inbox.store.rows) == 5


def test_exhausted_retries_leave_no_inbox_row_for_the_dead_letter():
    calls = Calls(fail={1: -1})
    inbox = FakeInbox(calls, retry=RetryPolicy(max_attempts=2, backoff_initial_s=0.1))
    result = inbox.deliver(*records(3))
    assert result.applied == 2 and result.dead_lettered == 1 and result.settled == 3
    assert [letter.record.offset for letter in inbox.dead_letters.letters] == [1]
    assert len(inbox.store.rows) == 2


def test_a_repeated_event_id_claims_record_by_record():
    calls = Calls()
    inbox = FakeInbox(calls)
    journal = counting(inbox)
    twice = records(1, start=5)[0]
    result = inbox.deliver(twice, *records(2), twice)
    assert (result.applied, result.duplicates) == (3, 1) and "claim_many" not in journal


def test_a_batch_handler_gets_the_new_messages_at_once_and_falls_back_one_by_one():
    batches: list[list[int]] = []

    def apply(conn: Any, messages: Sequence[InboxMessage]) -> None:
        ns = [m.json()["n"] for m in messages]
        batches.append(ns)
        if 3 in ns:
            raise RuntimeError("bad 3")

    inbox = FakeInbox(batch_handler=apply, retry=RetryPolicy(max_attempts=2, backoff_initial_s=0.1))
    seen = records(2)
    inbox.deliver(*seen)
    result = inbox.deliver(*seen, *records(3, start=2))
    assert batches[:3] == [[0, 1], [2, 3, 4], [2]]  # duplicates are not passed; then one by one
    assert batches.count([4]) == 1 and [0] not in batches
    assert result.duplicates == 2 and result.applied == 2 and result.dead_lettered == 1
    assert [letter.record.offset for letter in inbox.dead_letters.letters] == [3]
    assert [r.offset for r in inbox.settled][-5:] == [0, 1, 2, 3, 4]
