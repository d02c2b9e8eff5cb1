"""The mark thread: merges queued batches whose tokens agree, keeps order, hands errors back;
the mark lanes: split large batches by shard over several connections, each shard's marks in
submission order."""

from __future__ import annotations

import random
import threading
from collections import Counter
from typing import Any

import pytest

from relay.errors import DatabaseUnavailable
from relay.mark_lanes import MarkLanes
from relay.marker import Marker
from relay.model import Lease, OutboxRow, RowId, ShardId, Token
from tests.fixtures.procs import wait_until


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


# -- the lanes --------------------------------------------------------------------------------


def rows_over(shards: int, per_shard: int, start: int = 0) -> list[OutboxRow]:
    """``per_shard`` rows of each of ``shards`` shards, interleaved as a claim returns them."""
    return [row(start + i, shard=i % shards) for i in range(shards * per_shard)]


def tokens_of(shards: range) -> dict[ShardId, Token]:
    return {ShardId(s): Token(10 + s) for s in shards}


def open_store(held: set[int]) -> GatedStore:
    store = GatedStore(held=held)
    store.gate.set()
    return store


def test_a_large_batch_is_split_by_shard_and_each_part_carries_only_its_tokens() -> None:
    a, b = open_store(set(range(4))), open_store(set(range(4)))
    lanes = MarkLanes([a, b], "me", split_rows=8)
    lanes.start()
    held, marked, _ = lanes.submit(tokens_of(range(4)), rows_over(4, 2)).result(timeout=10)
    lanes.stop()
    assert held == {0, 1, 2, 3} and marked == set(range(8))
    assert len(a.calls) == len(b.calls) == 1  # both connections marked, once each
    (tokens_a, ids_a), (tokens_b, ids_b) = a.calls[0], b.calls[0]
    shards_a, shards_b = {i % 4 for i in ids_a}, {i % 4 for i in ids_b}
    assert shards_a and shards_b and not shards_a & shards_b  # a shard is on one lane only
    assert set(tokens_a) == shards_a and set(tokens_b) == shards_b
    assert all(tokens_a[s] == 10 + s for s in shards_a)
    assert sorted(ids_a + ids_b) == list(range(8)) and ids_a == sorted(ids_a)  # claim order kept


def test_a_small_batch_goes_whole_to_one_connection() -> None:
    a, b = open_store({0, 1, 2}), open_store({0, 1, 2})
    lanes = MarkLanes([a, b], "me", split_rows=200)
    lanes.start()
    for n in range(5):  # a paced relay's marks: one statement each, the second lane never used
        lanes.submit(tokens_of(range(3)), rows_over(3, 1, start=3 * n)).result(timeout=10)
    lanes.stop()
    assert [ids for _, ids in a.calls] == [[3 * n, 3 * n + 1, 3 * n + 2] for n in range(5)]
    assert b.calls == []


def test_a_shard_stays_on_its_lane_while_it_marks_there() -> None:
    a, b = GatedStore(held=set(range(4))), open_store(set(range(4)))
    lanes = MarkLanes([a, b], "me", split_rows=8)
    lanes.start()
    first = lanes.submit(tokens_of(range(1)), [row(0, shard=0)])  # small: lane a, which blocks
    assert a.entered.wait(10)
    second = lanes.submit(tokens_of(range(4)), rows_over(4, 4, start=100))  # large, shard 0 again
    # Shard 0's rows of the second batch are queued behind its first, on a; the other
    # shards are free to go to b, and do.
    wait_until(lambda: len(b.calls) == 1, timeout_s=10, message="b marked its part")
    assert all(i % 4 != 0 for _, ids in b.calls for i in ids) and lanes.moves == 0
    a.gate.set()
    assert first.result(timeout=10)[1] == {0}
    assert second.result(timeout=10)[1] == set(range(100, 116))
    lanes.stop()
    zero = [i for _, ids in a.calls for i in ids if i % 4 == 0]
    assert zero == [0, 100, 104, 108, 112]


def test_shards_moved_to_even_out_a_split_wait_for_their_earlier_marks() -> None:
    calls: list[str] = []

    class Recorded(GatedStore):
        def __init__(self, name: str) -> None:
            super().__init__(held=set(range(4)))
            self.name = name

        def mark_published(self, *, owner: str, leases: list[Lease],
                           rows: list[OutboxRow]) -> tuple[set[ShardId], set[RowId]]:
            result = super().mark_published(owner=owner, leases=leases, rows=rows)
            calls.append(self.name)
            return result

    a, b = Recorded("a"), Recorded("b")
    b.gate.set()
    lanes = MarkLanes([a, b], "me", split_rows=8)
    lanes.start()
    first = lanes.submit(tokens_of(range(4)), rows_over(4, 1))  # small: every shard on a, blocked
    assert a.entered.wait(10)
    second = lanes.submit(tokens_of(range(4)), rows_over(4, 4, start=100))  # 16 rows, all homed on a
    assert lanes.moves == 2  # two shards go to b to even the split out...
    threading.Event().wait(0.2)
    assert b.calls == []  # ...and wait there for a's mark of them
    a.gate.set()
    assert first.result(timeout=10)[1] == {0, 1, 2, 3}
    assert second.result(timeout=10)[1] == set(range(100, 116))
    lanes.stop()
    assert calls[0] == "a" and sorted(calls) == ["a", "a", "b"]
    on_b = {i % 4 for _, ids in b.calls for i in ids}
    assert len(on_b) == 2 and len(b.calls[0][1]) == 8


def test_a_few_shards_that_cannot_be_evened_out_stay_put() -> None:
    a, b = GatedStore(held=set(range(3))), GatedStore(held=set(range(3)))
    lanes = MarkLanes([a, b], "me", split_rows=100)
    lanes.start()
    rng = random.Random(3)
    futures = []
    for n in range(30):  # three shards, 150-210 rows each, while both lanes are busy
        batch = [row(1000 * n + 300 * s + i, shard=s) for s in range(3) for i in range(rng.randrange(150, 210))]
        futures.append(lanes.submit(tokens_of(range(3)), batch))
    moves_while_busy = lanes.moves
    a.gate.set()
    b.gate.set()
    marked = set().union(*(future.result(timeout=10)[1] for future in futures))
    lanes.stop()
    # The first batch spreads the shards 2 / 1; after that no split can be evened out
    # without swapping which lane is busier, so nothing moves (and nothing waits).
    assert moves_while_busy == 0 and lanes.moves == 0
    assert marked == {i for _, ids in a.calls + b.calls for i in ids} and len(marked) > 30 * 3 * 150


def test_every_shard_is_marked_in_submission_order_under_random_delays() -> None:
    order: list[tuple[int, int]] = []  # (shard, row id) in the order statements ran
    lock = threading.Lock()
    delays, draws = random.Random(7), random.Random(11)

    class SlowStore:
        def mark_published(self, *, owner: str, leases: list[Lease],
                           rows: list[OutboxRow]) -> tuple[set[ShardId], set[RowId]]:
            threading.Event().wait(delays.random() / 500)  # 0-2 ms: the lanes overtake each other
            with lock:
                order.extend((r.shard, r.id) for r in rows)
            return {lease.shard for lease in leases}, {r.id for r in rows}

    lanes = MarkLanes([SlowStore(), SlowStore(), SlowStore()], "me", split_rows=10)
    lanes.start()
    futures, next_id = [], 0
    for _ in range(300):
        size = draws.choice([1, 3, 12, 40])
        batch = [row(next_id + i, shard=draws.randrange(8)) for i in range(size)]
        next_id += size
        futures.append(lanes.submit(tokens_of(range(8)), batch))
    marked = set().union(*(f.result(timeout=30)[1] for f in futures))
    lanes.stop()
    assert marked == set(range(next_id)) and sorted(i for _, i in order) == list(range(next_id))
    by_shard: dict[int, list[int]] = {}
    for shard, row_id in order:
        by_shard.setdefault(shard, []).append(row_id)
    assert len(by_shard) == 8 and all(ids == sorted(ids) for ids in by_shard.values())
    overtaken = sum(1 for (_, x), (_, y) in zip(order, order[1:], strict=False) if y < x)
    assert overtaken > 0  # the lanes did run out of submission order across shards
    assert lanes._queued == [0, 0, 0] and lanes._last == {}


def test_a_failed_part_fails_its_batch_and_the_lanes_go_on() -> None:
    a, b = open_store({0, 1}), GatedStore(held={0, 1}, fail_on=1)
    b.gate.set()
    lanes = MarkLanes([a, b], "me", split_rows=2)
    lanes.start()
    with pytest.raises(DatabaseUnavailable):
        lanes.submit(tokens_of(range(2)), rows_over(2, 2)).result(timeout=10)
    # The part that went through stays marked; the next batches are marked as usual.
    assert len(a.calls) == 1
    held, marked, _ = lanes.submit(tokens_of(range(2)), rows_over(2, 2, start=10)).result(timeout=10)
    lanes.stop()
    assert held == {0, 1} and marked == {10, 11, 12, 13}
    assert lanes._queued == [0, 0] and lanes._last == {}


def test_a_shard_lost_on_one_lane_comes_back_as_not_held() -> None:
    a, b = open_store({0, 1, 2, 3}), open_store(set())  # b's statement finds no lease held
    lanes = MarkLanes([a, b], "me", split_rows=2)
    lanes.start()
    held, marked, _ = lanes.submit(tokens_of(range(4)), rows_over(4, 1)).result(timeout=10)
    lanes.stop()
    on_b = {i % 4 for _, ids in b.calls for i in ids}
    assert on_b and held == {0, 1, 2, 3} - on_b
    assert marked == {i for i in range(4) if i % 4 not in on_b}


def test_every_lane_has_its_thread_and_stop_ends_them_all() -> None:
    lanes = MarkLanes([open_store({0}), open_store({0})], "me")
    lanes.start()
    names = Counter(t.name for t in threading.enumerate())
    assert names["outbox-relay-mark"] == 1 and names["outbox-relay-mark-2"] == 1
    lanes.stop(5.0)
    lanes.stop(5.0)  # idempotent
    names = Counter(t.name for t in threading.enumerate())
    assert names["outbox-relay-mark"] == 0 and names["outbox-relay-mark-2"] == 0
    with pytest.raises(ValueError):
        MarkLanes([], "me")


class PingedStore(GatedStore):
    """A store whose connection answers its probe only once ``answer`` is set (a pooler with
    no server free), or fails it while ``fail`` is set."""

    def __init__(self, held: set[int]) -> None:
        super().__init__(held=held)
        self.gate.set()
        self.answer = threading.Event()
        self.fail = False
        self.pings = 0

    def ping(self) -> None:
        self.pings += 1
        if self.fail:
            raise DatabaseUnavailable("no server")
        assert self.answer.wait(10)


def test_a_connection_that_does_not_answer_gets_no_work_until_it_does() -> None:
    a, b = open_store(set(range(4))), PingedStore(set(range(4)))
    lanes = MarkLanes([a, b], "me", split_rows=4)
    lanes.start()
    lanes.submit(tokens_of(range(4)), rows_over(4, 2)).result(timeout=10)
    assert b.pings == 0  # the first lane's connection marks before another one is opened
    wait_until(lambda: lanes._first_marked, timeout_s=10, message="the first lane marked")
    for n in range(1, 4):  # large batches: b is probed, and meanwhile a marks everything
        assert lanes.submit(tokens_of(range(4)), rows_over(4, 2, start=10 * n)).result(timeout=10)[1] == \
            set(range(10 * n, 10 * n + 8))
    wait_until(lambda: b.pings == 1, timeout_s=10, message="one probe")
    assert len(a.calls) == 4 and b.calls == [] and b.pings == 1  # one probe, still waiting
    b.answer.set()
    wait_until(lambda: lanes._ready[1], timeout_s=10, message="the probe answered")
    lanes.submit(tokens_of(range(4)), rows_over(4, 2, start=100)).result(timeout=10)
    lanes.stop()
    assert len(b.calls) == 1 and len(a.calls) == 5  # split between both from then on


def test_a_failed_probe_is_tried_again_later_and_logged() -> None:
    now = [0.0]
    events: list[tuple[str, dict[str, Any]]] = []

    class Log:
        def warning(self, event: str, **kw: Any) -> None:
            events.append((event, kw))

        def info(self, event: str, **kw: Any) -> None:
            events.append((event, kw))

    a, b = open_store({0, 1}), PingedStore({0, 1})
    b.fail = True
    lanes = MarkLanes([a, b], "me", split_rows=2, log=Log(), probe_every_s=10.0, clock=lambda: now[0])
    lanes.start()
    lanes.submit(tokens_of(range(2)), rows_over(2, 2)).result(timeout=10)
    wait_until(lambda: lanes._first_marked, timeout_s=10, message="the first lane marked")
    lanes.submit(tokens_of(range(2)), rows_over(2, 2, start=10)).result(timeout=10)
    wait_until(lambda: b.pings == 1 and not lanes._probing[1], timeout_s=10, message="the first probe failed")
    lanes.submit(tokens_of(range(2)), rows_over(2, 2, start=20)).result(timeout=10)
    assert b.pings == 1  # not before probe_every_s
    assert events and events[0][0] == "mark_connection_unavailable" and "no server" in events[0][1]["error"]
    b.fail, now[0] = False, 11.0
    b.answer.set()
    lanes.submit(tokens_of(range(2)), rows_over(2, 2, start=30)).result(timeout=10)
    wait_until(lambda: lanes._ready[1], timeout_s=10, message="the second probe answered")
    assert b.pings == 2 and events[-1][0] == "mark_connection_ready"
    lanes.submit(tokens_of(range(2)), rows_over(2, 2, start=40)).result(timeout=10)
    lanes.stop()
    assert len(b.calls) == 1 and len(a.calls) == 5
