"""Exactly-once mode: a partition without a leader holds up whole shard transactions, and
with them the outcomes of rows of healthy partitions (delivered, not committed) and of the
rows buffered behind them.  The stall tracker names only the partitions of rows handed to
Kafka and not delivered (the shard workers' delivery reports, before the commit), and still
treats every waiting row as before (keys held, batches set aside).

Pure logic: relay.stalls with fake batches, the pump with a fake transactional publisher,
and relay.exactly_once_shard.SentRows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from relay.exactly_once_shard import SentRows
from relay.metrics import RelayMetrics
from relay.model import OutboxRow, RowId
from relay.outcomes import Outcome
from relay.pump import Pump
from relay.stalls import STALL_AFTER_S, UNATTRIBUTED_AFTER_S, Leaderless, Stalls
from tests.unit.pump_fakes import Leases, Publisher, Store, row

PARTITIONS = 3  # key k<i> goes to partition i % 3


def key_partition(r: OutboxRow) -> int | None:
    return int(r.key[1:]) % PARTITIONS if r.key else None


@dataclass
class Batch:
    rows: list[OutboxRow]
    produced_at: float = 0.0
    outcomes: dict[RowId, object] = field(default_factory=dict)


def keyed(start: int, count: int) -> list[OutboxRow]:
    return [row(i, 0, key=f"k{i}") for i in range(start, start + count)]


def test_only_the_partition_of_rows_not_delivered_is_named() -> None:
    batch = Batch(keyed(0, 9))  # three rows on each partition, none with an outcome
    undelivered = {r.id for r in batch.rows if key_partition(r) == 0}
    stalls = Stalls(partition_of=key_partition, undelivered=undelivered.__contains__)
    stalls.update([batch], STALL_AFTER_S)
    assert stalls.partitions == {("t", 0): 3}
    assert json.loads(stalls.as_json()) == {"t": {"0": 3}}
    # The pump's handling is that of every waiting row, as before.
    assert stalls.waiting == {("t", 0): 3, ("t", 1): 3, ("t", 2): 3}
    assert stalls.keys == {f"k{i}" for i in range(9)}
    assert stalls.stalled(batch, STALL_AFTER_S)
    assert stalls.holds(row(20, 0, key="k1"))  # a later row of a key waiting on partition 1
    assert stalls.holds(row(21, 0, key="k4"))  # a new key of partition 1: held as before


def answering(leaderless: frozenset[int] | None) -> Leaderless:
    return lambda topic: leaderless


def test_of_the_rows_not_sent_only_the_partitions_without_a_leader_are_named() -> None:
    # librdkafka adds a transaction's partitions together: the rows of partitions 1 and 2
    # added with the leaderless partition 0 are never sent either.  The metadata tells.
    batch = Batch(keyed(0, 9))
    asked: list[str] = []

    def leaderless(topic: str) -> frozenset[int] | None:
        asked.append(topic)
        return frozenset({0})

    stalls = Stalls(partition_of=key_partition, undelivered=lambda row_id: True, leaderless=leaderless)
    stalls.update([batch], STALL_AFTER_S)
    assert stalls.partitions == {("t", 0): 3} and asked == ["t"]
    assert stalls.waiting == {("t", 0): 3, ("t", 1): 3, ("t", 2): 3}
    everything = {("t", 0): 3, ("t", 1): 3, ("t", 2): 3}
    stalls = Stalls(partition_of=key_partition, undelivered=lambda row_id: True, leaderless=answering(None))
    stalls.update([batch], STALL_AFTER_S)  # no answer: all named
    assert stalls.partitions == stalls.named == everything


def test_a_stall_the_metadata_blames_on_no_partition_is_named_only_when_old() -> None:
    """Until the controller fences a dead broker (broker.session.timeout.ms, 9 s by default)
    the metadata names it its partitions' leader: the partitions of every waiting row were
    named stalled, healthy ones too.  Now none until UNATTRIBUTED_AFTER_S (then all, as
    before: a transaction may wait on its coordinator); the pump's handling is the same."""
    batch = Batch(keyed(0, 9))
    answer: list[frozenset[int]] = [frozenset()]
    stalls = Stalls(partition_of=key_partition, undelivered=lambda row_id: True,
                    leaderless=lambda topic: answer[0])
    stalls.update([batch], STALL_AFTER_S)
    assert stalls.named == {} and json.loads(stalls.as_json()) == {}
    assert stalls.partitions == stalls.waiting == {("t", 0): 3, ("t", 1): 3, ("t", 2): 3}  # handled as before
    assert stalls.stalled(batch, STALL_AFTER_S) and stalls.holds(row(20, 0, key="k1"))
    answer[0] = frozenset({0})  # the broker fenced: partition 0 has no leader
    stalls.update([batch], STALL_AFTER_S + 5)
    assert stalls.named == stalls.partitions == {("t", 0): 3}
    answer[0] = frozenset()  # never fenced: something else holds the transactions up
    stalls.update([batch], UNATTRIBUTED_AFTER_S)
    assert stalls.named == {("t", 0): 3, ("t", 1): 3, ("t", 2): 3}


def test_without_the_hook_every_waiting_row_counts() -> None:
    batch = Batch(keyed(0, 6))
    stalls = Stalls(partition_of=key_partition)
    stalls.update([batch], STALL_AFTER_S)
    assert stalls.partitions == stalls.waiting == {("t", 0): 2, ("t", 1): 2, ("t", 2): 2}


def test_every_row_delivered_and_none_settled_still_names_a_stall() -> None:
    # The transaction waits on something else (its position record's partition, the
    # coordinator): its rows' partitions are named, as before, rather than nothing.
    batch = Batch(keyed(0, 6))
    stalls = Stalls(partition_of=key_partition, undelivered=lambda row_id: False)
    stalls.update([batch], STALL_AFTER_S)
    assert stalls.partitions == {("t", 0): 2, ("t", 1): 2, ("t", 2): 2}
    batch.outcomes.update((r.id, Outcome(ok=True)) for r in batch.rows)
    assert stalls.update([batch], STALL_AFTER_S + 1) is True  # the stall is over
    assert stalls.partitions == {} and stalls.waiting == {}


class TransactionalPublisher(Publisher):
    """One transaction for everything sent: no outcome until no row is on the leaderless
    partition; the rows of the other partitions are delivered meanwhile, and the rows sent
    after the first poll wait in a buffer (not handed to Kafka)."""

    def __init__(self) -> None:
        super().__init__(partition_of=key_partition, no_leader=0)

    HANDED = 10  # the first batch's rows are in the transaction; the later ones wait for it

    def undelivered(self, row_id: RowId) -> bool:
        handed = self.sent[:self.HANDED]
        return row_id in handed and any(r.id == row_id and key_partition(r) == self.no_leader
                                        for r, _ in self.queued)

    @staticmethod
    def leaderless(topic: str) -> frozenset[int] | None:
        return None  # the cluster's metadata does not answer: the rows' own sign alone

    def poll(self, timeout_s: float) -> int:
        if any(key_partition(r) == self.no_leader for r, _ in self.queued):
            return 0  # the transaction cannot commit
        served, self.queued = self.queued, []
        for r, callback in served:
            callback(r, Outcome(ok=True))
        return len(served)


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


class Log:
    def __init__(self) -> None:
        self.stalled: list[dict[str, Any]] = []

    def __getattr__(self, level: str) -> Any:
        def log(event: str, **kw: Any) -> None:
            if event == "partition_stalled":
                self.stalled.append(kw)
        return log


def stalling_pump(publisher: TransactionalPublisher) -> tuple[Clock, Store, Log, RelayMetrics, Pump]:
    """A pump of one shard with 30 keyed rows to send through ``publisher``."""
    clock, store, log, metrics = Clock(), Store(keyed(1, 30)), Log(), RelayMetrics()
    pump = Pump(store=store, publisher=publisher, leases=Leases(shards=[0]), nshards=1,  # type: ignore[arg-type]
                batch_size=10, pipeline_depth=2, max_attempts=3, backoff_initial_s=0.1,
                backoff_max_s=1.0, metrics=metrics, log=log, clock=clock)
    return clock, store, log, metrics, pump


def test_the_pump_names_only_the_leaderless_partition() -> None:
    publisher = TransactionalPublisher()
    clock, store, log, metrics, pump = stalling_pump(publisher)
    for _ in range(5):
        pump.run_once()
    clock.now += STALL_AFTER_S
    for _ in range(5):
        pump.run_once()
        clock.now += 0.1
    assert [(e["topic"], e["partition"]) for e in log.stalled] == [("t", 0)]
    gauge = {p: metrics.registry.get_sample_value("outbox_relay_stalled_rows", {"topic": "t", "partition": p})
             for p in ("0", "1", "2")}
    assert gauge["0"] and gauge["1"] is None and gauge["2"] is None, gauge
    assert set(json.loads(pump.stalls.as_json())["t"]) == {"0"}
    assert store.marked == []  # nothing settled: the transaction has not committed

    publisher.no_leader = None  # the leader is back: the transaction commits
    for _ in range(40):
        pump.run_once()
        clock.now += 0.1
    assert not store.pending and sorted(store.marked) == list(range(1, 31))
    assert metrics.registry.get_sample_value("outbox_relay_stalled_rows", {"topic": "t", "partition": "0"}) is None


class LateMetadataPublisher(TransactionalPublisher):
    """The cluster's metadata names partition 0's dead leader until the controller fences it."""

    fenced = False

    def leaderless(self, topic: str) -> frozenset[int] | None:  # type: ignore[override]
        return frozenset({0}) if self.fenced else frozenset()


def test_the_pump_names_no_healthy_partition_while_the_metadata_is_late() -> None:
    # Before: partition_stalled for partitions 0, 1 and 2 until the broker was fenced.
    publisher = LateMetadataPublisher()
    clock, store, log, metrics, pump = stalling_pump(publisher)
    for _ in range(5):
        pump.run_once()
    clock.now += STALL_AFTER_S
    for _ in range(20):
        pump.run_once()
        clock.now += 0.2
    assert log.stalled == [] and pump.stalls.partitions  # stalled, not named yet
    assert metrics.registry.get_sample_value("outbox_relay_stalled_rows", {"topic": "t", "partition": "1"}) is None
    publisher.fenced = True
    for _ in range(5):
        pump.run_once()
        clock.now += 0.2
    assert [(e["topic"], e["partition"]) for e in log.stalled] == [("t", 0)]
    assert set(json.loads(pump.stalls.as_json())["t"]) == {"0"}


def test_sent_rows_are_undelivered_until_reported_and_forgotten_with_their_transaction() -> None:
    rows = keyed(0, 3)
    old, new = object(), object()
    sent = SentRows()
    assert not sent.undelivered(rows[0].id)  # not handed to Kafka: buffered, or never sent
    for r in rows:
        sent.note(r.id, old, delivered=False)  # type: ignore[arg-type]
    sent.note(rows[0].id, old, delivered=True)  # type: ignore[arg-type]
    assert [sent.undelivered(r.id) for r in rows] == [False, True, True]
    sent.note(rows[2].id, new, delivered=False)  # type: ignore[arg-type]  # sent again, to a newer worker
    sent.forget(rows, old)  # type: ignore[arg-type]  # the old transaction's late result
    assert [sent.undelivered(r.id) for r in rows] == [False, False, True]
    sent.forget(rows, new)  # type: ignore[arg-type]
    assert not sent.undelivered(rows[2].id)
