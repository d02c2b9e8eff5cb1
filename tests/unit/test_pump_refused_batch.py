"""A broker refuses a whole record batch when one record in it is over its limit, and
every row produced beside that record gets MSG_SIZE_TOO_LARGE too.  Those rows must not
be dead-lettered: a row refused as too large is sent again alone before the refusal
counts against it.  Pure logic: the real Loop and Pump over the fakes, with a publisher
that refuses batches the way the broker does."""

from __future__ import annotations

from typing import Any

from relay.model import OutboxRow
from relay.publisher import Outcome
from tests.unit.pump_fakes import row
from tests.unit.test_loop import Relay

BROKER_LIMIT = 1000
REFUSED = Outcome(ok=False, error_class="message_too_large", permanent=True,
                  message="Broker: Message size too large")


def refuse_batches_with_a_big_record(relay: Relay) -> list[list[int]]:
    """Rows produced between two polls form one record batch; a batch holding a record
    over BROKER_LIMIT is refused whole.  Returns the batches as they were sent."""
    publisher = relay.publisher
    batches: list[list[int]] = []

    def poll(timeout_s: float) -> int:
        served, publisher.queued = publisher.queued, []
        if served:
            batches.append([r.id for r, _ in served])
        refused = any(len(r.value or b"") > BROKER_LIMIT for r, _ in served)
        for r, callback in served:
            callback(r, REFUSED if refused else Outcome(ok=True))
        return len(served)

    publisher.poll = poll  # type: ignore[method-assign]
    return batches


def big(i: int, shard: int) -> OutboxRow:
    return row(i, shard, key="big")._replace(value=b"x" * (2 * BROKER_LIMIT))


def run(rows: list[Any], max_attempts: int) -> tuple[Relay, list[list[int]]]:
    relay = Relay(rows, max_attempts=max_attempts, dead_letter_topic="orders.dlq")
    batches = refuse_batches_with_a_big_record(relay)
    relay.turn_until(lambda: not relay.store.pending and not relay.pump.busy(), limit=5000)
    return relay, batches


def test_rows_refused_beside_an_oversized_record_are_sent_again_alone_and_delivered() -> None:
    rows = [big(1, 0)] + [row(i, i % 2, key=f"k{i % 5}") for i in range(2, 22)]
    relay, batches = run(rows, max_attempts=1)
    assert relay.store.dead == [(1, "message_too_large")]
    assert sorted(relay.store.marked) == list(range(2, 22))
    # Refused once beside the big record, then each sent alone: no attempt counted.
    assert batches[0][0] == 1 and len(batches[0]) > 1
    assert [1] in batches[1:]
    assert [i for i, *_ in relay.store.failures] == []
    assert relay.pump.failures.suspects == {} and relay.pump.failures.isolated == set()


def test_the_oversized_row_uses_one_attempt_per_refusal_alone() -> None:
    rows = [big(1, 0), row(2, 0, key="k"), row(3, 1, key="k3")]
    relay, batches = run(rows, max_attempts=3)
    assert relay.store.dead == [(1, "message_too_large")]
    assert [(i, n) for i, n, _, _ in relay.store.failures] == [(1, 1), (1, 2)]
    assert sorted(relay.store.marked) == [2, 3]
    # Beside other rows only once (that refusal did not count); alone for each attempt.
    assert [b for b in batches if 1 in b and b != [1]] == [[1, 2, 3]]
    assert batches.count([1]) >= 3


def test_a_batch_too_large_only_as_a_whole_is_delivered_row_by_row() -> None:
    # Records of 600 bytes: any two in one batch are over the limit, each alone is not.
    rows = [row(i, 0, key=f"k{i}")._replace(value=b"y" * 600) for i in range(1, 6)]
    relay = Relay(rows, max_attempts=1, dead_letter_topic="orders.dlq")
    publisher, batches = relay.publisher, []

    def poll(timeout_s: float) -> int:
        served, publisher.queued = publisher.queued, []
        if served:
            batches.append([r.id for r, _ in served])
        refused = sum(len(r.value or b"") for r, _ in served) > BROKER_LIMIT
        for r, callback in served:
            callback(r, REFUSED if refused else Outcome(ok=True))
        return len(served)

    publisher.poll = poll  # type: ignore[method-assign]
    relay.turn_until(lambda: not relay.store.pending and not relay.pump.busy(), limit=5000)
    assert relay.store.dead == []
    assert sorted(relay.store.marked) == [1, 2, 3, 4, 5]
