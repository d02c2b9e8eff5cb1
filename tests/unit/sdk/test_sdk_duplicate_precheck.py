"""Issue 19: a batch's duplicates are found by one lookup before any transaction, so a
redelivered batch costs no claim, no savepoint and no transaction; what the lookup does not
settle (new events, a body that differs, replays) is claimed in the transaction as before.
A lookup that finds nothing is skipped until a claim meets a duplicate again.
On the in-memory fakes, with the lookup the PostgreSQL store has (``applied_before``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from consumer_sdk import InboxMessage
from consumer_sdk.testing import FakeInbox, make_record


class Journal:
    """Wraps a FakeInbox's store: gives it ``applied_before`` and records what is called."""

    def __init__(self, inbox: FakeInbox) -> None:
        self.calls: list[str] = []
        self.looked_up: list[Any] = []
        self.claimed: list[Any] = []
        store = inbox.store
        transaction, claim_many = store.transaction, store.claim_many

        @contextmanager
        def counted_transaction() -> Iterator[Any]:
            self.calls.append("transaction")
            with transaction() as conn:
                yield conn

        def counted_claim_many(*, consumer: str, messages: Sequence[InboxMessage], digests: Any) -> Any:
            self.calls.append("claim_many")
            self.claimed.extend(m.event_id for m in messages)
            return claim_many(consumer=consumer, messages=messages, digests=digests)

        def applied_before(*, consumer: str, event_ids: Sequence[Any]) -> dict[Any, bytes | None]:
            self.calls.append("applied_before")
            self.looked_up.extend(event_ids)
            wanted = set(event_ids)
            return {e: h for (c, e), h in store.rows.items() if c == consumer and e in wanted}

        store.transaction = counted_transaction  # type: ignore[method-assign]
        store.claim_many = counted_claim_many  # type: ignore[method-assign]
        store.applied_before = applied_before  # type: ignore[attr-defined]


class Calls:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, conn: Any, message: InboxMessage) -> None:
        self.calls.append(message.json()["n"])


def records(count: int, start: int = 0) -> list[Any]:
    return [make_record(value={"n": i}, offset=i) for i in range(start, start + count)]


def test_a_redelivered_batch_opens_no_transaction_and_claims_nothing():
    calls = Calls()
    inbox = FakeInbox(calls)
    journal = Journal(inbox)
    first, second = records(5), records(5, start=5)
    assert inbox.deliver(*first).applied == 5
    assert journal.calls == ["applied_before", "transaction", "claim_many"]
    journal.calls.clear()
    assert inbox.deliver(*second).applied == 5
    assert journal.calls == ["transaction", "claim_many"]  # new messages: the lookup found nothing, skipped
    journal.calls.clear()
    assert inbox.deliver(*first).duplicates == 5  # the first redelivered batch: its claim meets them
    assert journal.calls == ["transaction", "claim_many"]
    journal.calls.clear()
    result = inbox.deliver(*second)  # the rest of the redelivery: the lookup only
    assert (result.duplicates, result.applied, result.settled) == (5, 0, 5)
    assert journal.calls == ["applied_before"]
    assert calls.calls == list(range(10))  # the handlers ran once, on the first delivery
    assert inbox.settled == first + second + first + second  # settled, in order, every time


def test_a_partly_redelivered_batch_claims_only_what_the_lookup_did_not_settle():
    calls = Calls()
    inbox = FakeInbox(calls)
    journal = Journal(inbox)
    old = records(2)
    inbox.deliver(*old)
    inbox.deliver(*old)  # a redelivery: duplicates are looked up from now on
    journal.calls.clear()
    journal.claimed.clear()
    new = records(3, start=2)
    result = inbox.deliver(old[0], new[0], old[1], new[1], new[2])
    assert (result.applied, result.duplicates) == (3, 2)
    assert journal.calls == ["applied_before", "transaction", "claim_many"]
    assert [str(e) for e in journal.claimed] == [dict(r.headers)["event_id"].decode() for r in new]
    assert calls.calls == [0, 1, 2, 3, 4]
    assert inbox.settled[-5:] == [old[0], new[0], old[1], new[1], new[2]]


def test_a_reused_event_id_with_another_body_is_still_a_mismatch():
    inbox = FakeInbox(Calls())
    Journal(inbox)
    first = make_record(value={"n": 1}, offset=0)
    event_id = dict(first.headers)["event_id"].decode()
    inbox.deliver(first)
    result = inbox.deliver(make_record(value={"n": 2}, offset=1, event_id=event_id))
    assert (result.mismatches, result.duplicates, result.dead_lettered) == (1, 0, 1)


def test_replayed_records_are_not_looked_up_under_the_consumer_name():
    inbox = FakeInbox(Calls())
    journal = Journal(inbox)
    plain = make_record(value={"n": 1}, offset=0)
    replayed = make_record(value={"n": 2}, offset=1, headers={"replay_id": "r1"})
    inbox.deliver(plain, replayed)
    assert [str(e) for e in journal.looked_up] == [dict(plain.headers)["event_id"].decode()]
