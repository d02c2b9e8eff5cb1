"""One message at a time (``batch_size=1``) with a store that defers each COMMIT to the next
transaction and looks duplicates up before a poll, as PgInboxStore does: the processor takes a
lean path for each record there.
Every outcome must be the one of the general path (a store that commits at once): the same
records settled in the same order, the same counts, handler calls, dead letters and inbox
rows.  On the in-memory fakes (no sockets)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import astuple
from typing import Any

import pytest
import structlog

from consumer_sdk import (
    ConsumerStopped,
    DeadLetterBlocked,
    DeadLetterFailed,
    InboxMessage,
    PermanentError,
)
from consumer_sdk.metrics import ConsumerMetrics
from consumer_sdk.model import BatchResult, KafkaRecord, RetryPolicy
from consumer_sdk.processor import Policies, Processor
from consumer_sdk.store import PgInboxStore
from consumer_sdk.testing import FakeDeadLetters, FakeInboxStore, make_record


class DeferringStore(FakeInboxStore):
    """The fake inbox with PgInboxStore's deferred COMMIT: a transaction's ``on_commit`` runs
    when the next transaction begins (or at ``sync``)."""

    def __init__(self) -> None:
        super().__init__()
        self._pending: list[Callable[[], None]] | None = None

    @contextmanager
    def transaction(self, *, on_commit: Callable[[], None] | None = None,  # type: ignore[override]
                    defer_commit: bool = False) -> Iterator[Any]:
        self.sync()  # the deferred COMMIT rides with this transaction's first round trip
        with super().transaction() as conn:
            yield conn
        if defer_commit:
            self._pending = [on_commit] if on_commit is not None else []
        elif on_commit is not None:
            on_commit()

    # The store's own rules over ``_pending``, not a copy of them.
    commit_pending = PgInboxStore.commit_pending
    after_commit = PgInboxStore.after_commit

    def sync(self) -> None:
        pending, self._pending = self._pending, None
        for callback in pending or ():
            callback()

    def discard(self) -> None:
        self._pending = None

    def applied_before(self, *, consumer: str, event_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, bytes | None]:
        """The lookup before a poll (PgInboxStore's), so that duplicates it finds take that path."""
        if self._pending is not None:
            raise RuntimeError("applied_before() runs with no deferred COMMIT")
        return {e: self.rows[(consumer, e)] for e in event_ids if (consumer, e) in self.rows}


class Handler:
    """Counts calls; fails on demand (n -> failures left, -1 forever; or permanently)."""

    def __init__(self, fail: dict[int, int] | None = None, permanent: frozenset[int] = frozenset()) -> None:
        self.calls: list[int] = []
        self.fail = dict(fail or {})
        self.permanent = permanent

    def __call__(self, conn: Any, message: InboxMessage) -> None:
        n = message.json()["n"]
        self.calls.append(n)
        if n in self.permanent:
            raise PermanentError(f"bad {n}")
        if self.fail.get(n, 0):
            self.fail[n] -= 1
            raise RuntimeError(f"boom {n}")


def run(store: FakeInboxStore, deliveries: list[list[KafkaRecord]], *, handler: Handler,
        policies: Policies, dead_letters: FakeDeadLetters | None = None) -> dict[str, Any]:
    """Every delivery through one processor (batch_size=1); what happened, comparable."""
    settled: list[KafkaRecord] = []
    letters = dead_letters or FakeDeadLetters()
    metrics = ConsumerMetrics()
    processor = Processor(consumer="one", store=store, handler=handler, dead_letters=letters, policies=policies,
                          metrics=metrics, log=structlog.get_logger("tests.sdk"), sleep=lambda s: None,
                          on_settled=settled.extend, batch_size=1)
    results: list[Any] = []
    for records in deliveries:
        result = BatchResult()
        try:
            processor.process(records, result)
        except (ConsumerStopped, DeadLetterBlocked) as exc:
            results.append(type(exc).__name__)
        results.append(astuple(result)[:-1] + (tuple(d.reason for d in result.dead_letters),))
    sample = metrics.registry.get_sample_value
    return {"results": results, "settled": [(r.partition, r.offset) for r in settled], "calls": handler.calls,
            "letters": [(d.record.offset, d.reason, d.attempts) for d in letters.letters],
            "rows": sorted((str(k[1]), v) for k, v in store.rows.items()),
            "applied": sample("outbox_consumer_messages_processed_total", {"consumer": "one", "topic": "test"}),
            "dropped": sample("outbox_consumer_duplicates_dropped_total", {"consumer": "one", "topic": "test"})}


def same_outcome(deliveries: list[list[KafkaRecord]], *, handler: Callable[[], Handler],
                 policies: Policies | None = None,
                 letters: Callable[[], FakeDeadLetters] = FakeDeadLetters) -> dict[str, Any]:
    chosen = policies or Policies()
    general = run(FakeInboxStore(), deliveries, handler=handler(), policies=chosen, dead_letters=letters())
    lean = run(DeferringStore(), deliveries, handler=handler(), policies=chosen, dead_letters=letters())
    assert lean == general
    return lean


def rec(n: int, offset: int | None = None, **kwargs: Any) -> KafkaRecord:
    return make_record(value={"n": n}, offset=n if offset is None else offset, **kwargs)


RETRY = Policies(retry=RetryPolicy(max_attempts=3, backoff_initial_s=0.1))


def test_new_messages_and_failures_retried_or_dead_lettered():
    batch = [rec(n) for n in range(8)]
    outcome = same_outcome([batch], handler=lambda: Handler(fail={2: 2, 5: -1}, permanent=frozenset({6})),
                           policies=RETRY)
    assert outcome["calls"] == [0, 1, 2, 2, 2, 3, 4, 5, 5, 5, 6, 7]
    assert [reason for _, reason, _ in outcome["letters"]] == ["retries_exhausted", "permanent_error"]
    assert outcome["settled"] == [(0, n) for n in range(8)]


def test_duplicates_redelivered_within_and_across_polls():
    first = [rec(n) for n in range(4)]
    again = [first[1], rec(10), first[1], first[3], rec(11)]
    outcome = same_outcome([first, again, first], handler=Handler)
    assert outcome["calls"] == [0, 1, 2, 3, 10, 11]
    assert outcome["dropped"] == 7.0


def test_invalid_event_ids_and_mismatches_follow_their_policies():
    event_id = uuid.uuid4()
    deliveries = [[rec(1, event_id=event_id), rec(2, omit_event_id=True), rec(3, offset=3, event_id=event_id),
                   rec(4, headers={"event_id": "nope"}, omit_event_id=True), rec(5)]]
    for policies in (Policies(), Policies(on_invalid_event_id="skip", on_payload_mismatch="skip")):
        outcome = same_outcome(deliveries, handler=Handler, policies=policies)
        assert outcome["calls"] == [1, 5] and len(outcome["settled"]) == 5


def test_a_stop_policy_settles_the_records_before_it():
    event_id = uuid.uuid4()
    deliveries = [[rec(1, event_id=event_id), rec(2), rec(3, event_id=event_id), rec(4)]]
    outcome = same_outcome(deliveries, handler=Handler, policies=Policies(on_payload_mismatch="stop"))
    assert outcome["results"][0] == "ConsumerStopped" and outcome["settled"] == [(0, 1), (0, 2)]


def test_a_dead_letter_that_cannot_be_sent_blocks_after_the_records_before_it():
    def failing() -> FakeDeadLetters:
        letters = FakeDeadLetters()
        letters.fail = DeadLetterFailed("broker down")
        return letters

    outcome = same_outcome([[rec(1), rec(2), rec(3)]], handler=lambda: Handler(permanent=frozenset({2})),
                           letters=failing)
    assert outcome["results"][0] == "DeadLetterBlocked" and outcome["settled"] == [(0, 1)]


@pytest.mark.parametrize("fail", [{0: 1}, {3: -1}], ids=["first", "last"])
def test_a_failure_at_either_end_of_a_poll(fail):
    same_outcome([[rec(n) for n in range(4)]], handler=lambda: Handler(fail=fail), policies=RETRY)
