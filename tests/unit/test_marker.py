"""The mark thread: merges queued batches whose tokens agree, keeps order, hands errors back."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from relay.errors import DatabaseUnavailable
from relay.marker import Marker
from relay.model import Lease, OutboxRow, RowId, ShardId, Token


def row(i: int, shard: int = 0) -> OutboxRow:
    return OutboxRow(RowId(i), f"e{i}", "t", f"k{i}", b"{}", "{}", i, ShardId(shard), 0, 0.0)


class GatedStore:
    """Marks every row of the shards it is told are held; the first call waits for a gate."""


    def __init__(self, held: set[int], fail_on: int | None = None) -> None:
        self.held = held
        self.fail_on = fail_on
        self.calls: list[tuple[dict[int, int], list[int]]] = []
        self.gate = threading.Event()
        self.entered = threading.Event()

    def mark_published(self, *, owner: str, leases: list[Lease],
                       rows: list[OutboxRow]) -> tuple[set[ShardId], set[RowId]]:
        self.entered.set()
        self.gate.wait(10)
        self.calls.append(({lease.shard: lease.token for lease in leases}, [r.id for r in rows]))
        if self.fail_on is not None and len(self.calls) == self.fail_on:
            raise DatabaseUnavailable("connection lost")
        held = {ShardId(s) for s in self.held}
        return held, {r.id for r in rows if r.shard in held}


def test_batches_queued_behind_a_running_mark_share_one_statement() -> None:
    store = GatedStore(held={0, 1})
    marker = Marker(store, "me")
    marker.start()
    first = marker.submit({ShardId(0): Token(1)}, [row(1)])
    assert store.entered.wait(10)  # the first mark is running
    queued = [marker.submit({ShardId(0): Token(1)}, [row(2)]),
              marker.submit({ShardId(1): Token(7)}, [row(3, shard=1), row(4, shard=1)])]
    store.gate.set()
    marker.stop()
    assert first.result()[1] == {1}
    # Each batch gets back only its own ids, though they were marked together.
    assert [f.result()[1] for f in queued] == [{2}, {3, 4}]
    assert store.calls == [({0: 1}, [1]), ({0: 1, 1: 7}, [2, 3, 4])]


def test_a_changed_token_is_never_merged_into_the_same_statement() -> None:
    store = GatedStore(held={0})
    marker = Marker(store, "me")
    marker.start()
    marker.submit({ShardId(0): Token(1)}, [row(1)])
    assert store.entered.wait(10)
    a = marker.submit({ShardId(0): Token(1)}, [row(2)])
    b = marker.submit({ShardId(0): Token(2)}, [row(3)])  # the lease was taken again meanwhile
    store.gate.set()
    marker.stop()
    assert a.result()[1] == {2} and b.result()[1] == {3}
    assert store.calls == [({0: 1}, [1]), ({0: 1}, [2]), ({0: 2}, [3])]


def test_an_error_reaches_every_batch_of_the_failed_statement_and_the_next_one_runs() -> None:
    store = GatedStore(held={0}, fail_on=1)
    marker = Marker(store, "me")
    marker.start()
    failed = marker.submit({ShardId(0): Token(1)}, [row(1)])
    store.gate.set()
    with pytest.raises(DatabaseUnavailable):
        failed.result(timeout=10)
    later = marker.submit({ShardId(0): Token(1)}, [row(2)])
    assert later.result(timeout=10)[1] == {2}
    marker.stop()


def test_lost_shards_come_back_as_not_held() -> None:
    store: Any = GatedStore(held=set())
    store.gate.set()
    marker = Marker(store, "me")
    marker.start()
    held, marked, _ = marker.submit({ShardId(0): Token(1)}, [row(1)]).result(timeout=10)
    marker.stop()
    assert held == set() and marked == set()


def test_one_mark_thread_and_stop_is_idempotent() -> None:
    store: Any = GatedStore(held={0})
    store.gate.set()
    marker = Marker(store, "me")
    assert "outbox-relay-mark" not in [t.name for t in threading.enumerate()]  # not in __init__
    early = marker.submit({ShardId(0): Token(1)}, [row(1)])
    assert not early.done() and store.calls == []  # queued until the thread starts
    marker.start()
    marker.start()  # a second start is a no-op: one mark thread
    assert [t.name for t in threading.enumerate()].count("outbox-relay-mark") == 1
    assert early.result(timeout=10)[1] == {1}
    marker.stop(5.0)
    marker.stop(5.0)  # idempotent
    marker.start()  # a stopped marker stays stopped
    late = marker.submit({ShardId(0): Token(1)}, [row(2)])
    assert not late.done() and store.calls == [({0: 1}, [1])]
    assert [t.name for t in threading.enumerate()].count("outbox-relay-mark") == 0


def test_run_once_marks_one_merged_statement_per_call_without_a_thread() -> None:
    store = GatedStore(held={0, 1})
    store.gate.set()
    marker = Marker(store, "me", max_rows=3)  # never started: the test turns the loop
    assert marker.run_once(timeout_s=0.01) == 0  # nothing submitted
    futures = [marker.submit({ShardId(0): Token(1)}, [row(1), row(2)]),
               marker.submit({ShardId(0): Token(1)}, [row(3)]),   # merged: 3 rows, the limit
               marker.submit({ShardId(0): Token(1)}, [row(4)]),   # the next statement
               marker.submit({ShardId(0): Token(2)}, [row(5)])]   # a new token: its own
    assert marker.run_once() == 3
    assert marker.run_once() == 1
    assert marker.run_once() == 1
    assert store.calls == [({0: 1}, [1, 2, 3]), ({0: 1}, [4]), ({0: 2}, [5])]
    assert [f.result()[1] for f in futures] == [{1, 2}, {3}, {4}, {5}]
    assert marker.run_once(timeout_s=0.01) == 0 and not marker.stopped


def test_the_thread_marks_everything_submitted_before_stop_then_ends() -> None:
    store = GatedStore(held={0})
    store.gate.set()
    marker = Marker(store, "me")
    futures = [marker.submit({ShardId(0): Token(1)}, [row(i)]) for i in range(5)]
    marker.start()
    marker.stop()
    assert marker.stopped
    assert set().union(*(f.result()[1] for f in futures)) == {0, 1, 2, 3, 4}
