"""Partitions that acknowledge nothing, and the keys that must wait for them.

A partition without a leader (its broker down, a replication factor of one) keeps its
rows in the producer until the leader returns or ``message.timeout.ms`` passes.  Batches
used to settle strictly in order, so one such row held back the marks and the claims of
every other partition.  Now a row unreported for ``STALL_AFTER_S`` marks its partition as
stalled: the pump marks what the rest of its batch got acknowledged, stops counting the
batch against the pipeline, and produces nothing more for that partition or for the keys
of its waiting rows (per-key order) until the partition acknowledges again; the rows it
skipped are claimed again by a rewind once the stall is over.

In exactly-once mode a row's outcome comes with its shard's transaction's commit, so one
partition without a leader leaves the rows of every other partition in the same
transactions (and those buffered behind them) without an outcome too.  A publisher that
knows which rows it handed to Kafka and their leader has not taken (``undelivered``; the
others are delivered, not committed yet, or not produced yet), and which partitions have
no leader (``leaderless``: the rows of healthy partitions added to a transaction with a
leaderless one are never sent either, relay/exactly_once_leaders.py), lets the tracker
name only the partitions at fault (``named``: ``partition_stalled``, the gauge,
`outbox-relay status`); the keys held back and the batches set aside are those of every
row still waiting, as before (``waiting``), so the pump treats the rows the same.  Until the
controller fences a dead broker the metadata still names it its partitions' leader: a
stall the metadata blames on no partition is named only once older than
``UNATTRIBUTED_AFTER_S`` (then the partitions of every waiting row, as before: a stall is
never left unsaid), not the healthy partitions while the metadata catches up.

The partition of a keyed row is Kafka's default (murmur2 of the key, as the Java client
and librdkafka's ``murmur2_random`` partitioner compute it) over the topic's partition
count; a keyless row has none and is never held back.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from relay.model import OutboxRow, RowId

STALL_AFTER_S = 5.0  # no acknowledgement for this long: the row's partition is stalled
#: A dead broker stays its partitions' leader in the cluster's metadata until the controller
#: fences it (broker.session.timeout.ms, 9 s by default: 9.2 to 10.7 s after a kill measured
#: on three Apache Kafka brokers; asked again every 2 s meanwhile, relay/exactly_once_leaders.py).
#: Rows waiting this long that the metadata blames on no partition name the partitions of all
#: of them (a transaction waiting on its coordinator or its position record).
UNATTRIBUTED_AFTER_S = 20.0

Partition = tuple[str, int | None]  # (topic, partition; None when not computable)
Undelivered = Callable[[RowId], bool]  # the row was handed to its partition, which has not taken it
Leaderless = Callable[[str], "frozenset[int] | None"]  # a topic's partitions without a leader (None: unknown)


@runtime_checkable
class StallSigns(Protocol):
    """A publisher that knows which waiting rows their partition holds up and which partitions
    have no leader (relay.exactly_once.TransactionalPublisher); the default one does not."""

    def undelivered(self, row_id: RowId) -> bool: ...
    def leaderless(self, topic: str) -> frozenset[int] | None: ...


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (``org.apache.kafka.common.utils.Utils.murmur2``), as unsigned 32 bits."""
    m, h = 0x5BD1E995, (0x9747B28C ^ len(data)) & 0xFFFFFFFF
    whole = len(data) & ~3
    for i in range(0, whole, 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> 24
        k = (k * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    rest = len(data) - whole
    if rest == 3:
        h ^= data[whole + 2] << 16
    if rest >= 2:
        h ^= data[whole + 1] << 8
    if rest >= 1:
        h ^= data[whole]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h


def default_partition(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner gives a keyed record."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


class Waiting(Protocol):
    """What a batch in flight exposes to the tracker (relay.pump.InFlight)."""

    @property
    def produced_at(self) -> float: ...
    @property
    def rows(self) -> list[OutboxRow]: ...
    @property
    def outcomes(self) -> Mapping[RowId, object]: ...


@dataclass(slots=True)
class Stalls:
    """The stalled partitions and held keys, recomputed from the batches in flight."""

    partition_of: Callable[[OutboxRow], int | None]
    #: Which waiting rows their partition holds up (the others wait on something else; None:
    #: every waiting row counts): the exactly-once publisher's (relay/pump.py passes it).
    undelivered: Undelivered | None = None
    leaderless: Leaderless | None = None  # likewise: of the partitions named, those without a leader
    partitions: dict[Partition, int] = field(default_factory=dict)  # stalled -> rows not delivered
    #: Of ``partitions``, those to name (the log, the gauge, the status): all of them, but
    #: none while the metadata, which may lag a broker's death, blames none.
    named: dict[Partition, int] = field(default_factory=dict)
    waiting: dict[Partition, int] = field(default_factory=dict)  # -> rows waiting (delivered or not)
    keys: set[str] = field(default_factory=set)  # keys with a row waiting on a stalled partition
    held: set[str] = field(default_factory=set)  # keys skipped since: claimed again by a rewind
    rewind_after: bool = False  # rows were skipped: rewind once no partition is stalled
    # The partition of each row still waiting: update() runs every loop turn, and murmur2
    # in Python is not free for thousands of waiting rows.
    _placed: dict[RowId, Partition] = field(default_factory=dict, init=False, repr=False)

    def update(self, batches: Iterable[Waiting], now: float) -> bool:
        """Recompute from ``batches`` (in production order); True when a stall just ended."""
        was = bool(self.partitions)
        waiting: dict[Partition, int] = {}
        undelivered: dict[Partition, int] = {}
        keys: set[str] = set()
        known, placed = self._placed, {}  # a waiting row's partition is computed once
        held_up = self.undelivered
        waited_s = 0.0  # by the oldest row still waiting
        for batch in batches:
            if now - batch.produced_at < STALL_AFTER_S:
                break  # later batches are younger still
            for row in batch.rows:
                if row.id not in batch.outcomes:
                    waited_s = max(waited_s, now - batch.produced_at)
                    where = known.get(row.id) or (row.topic, self.partition_of(row))
                    placed[row.id] = where
                    waiting[where] = waiting.get(where, 0) + 1
                    if held_up is None or held_up(row.id):
                        undelivered[where] = undelivered.get(where, 0) + 1
                    if row.key is not None:
                        keys.add(row.key)
        self.waiting, self.keys, self._placed = waiting, keys, placed
        self.partitions, blamed = stalled_partitions(waiting, undelivered, self.leaderless)
        self.named = self.partitions if blamed or waited_s >= UNATTRIBUTED_AFTER_S else {}
        return was and not self.partitions

    def as_json(self) -> str:
        """{"<topic>": {"<partition>": rows waiting}}: what `outbox-relay status` shows."""
        report: dict[str, dict[str, int]] = {}
        for (topic, partition), waiting in sorted(self.named.items(), key=str):
            report.setdefault(topic, {})[str(partition)] = waiting
        return json.dumps(report, sort_keys=True)

    def holds(self, row: OutboxRow) -> bool:
        """Whether ``row`` must not be produced now; remembers its key if so."""
        if not self.partitions and not self.held:
            return False
        key = row.key
        if key is None:
            return False  # a keyless row has no order to keep: it goes
        if (key not in self.keys and key not in self.held
                and (row.topic, self.partition_of(row)) not in self.waiting):
            return False
        self.held.add(key)
        self.rewind_after = True
        return True

    def stalled(self, batch: Waiting, now: float) -> bool:
        """A batch that only waits on stalled partitions: it no longer counts as in flight
        for the pipeline's depth, and its acknowledged rows are marked without it."""
        return now - batch.produced_at >= STALL_AFTER_S and bool(self.partitions)


def stalled_partitions(waiting: dict[Partition, int], undelivered: dict[Partition, int],
                       leaderless: Leaderless | None = None) -> tuple[dict[Partition, int], bool]:
    """The stalled partitions: those of rows not delivered and, when the cluster says some of
    them have no leader, only those.  When every waiting row waits on something else (a
    transaction whose commit waits on its position record's partition or on its
    coordinator), the partitions of all of them, as before: the pump's handling does not
    change.  And whether they are to blame: False when the cluster's metadata answered for
    every topic and said each of these partitions has a leader (its news of a broker's
    death may be late: ``UNATTRIBUTED_AFTER_S``)."""
    named = undelivered or waiting
    if leaderless is None or not named:
        return dict(named), True
    lacking: dict[str, frozenset[int] | None] = {topic: None for topic, _ in named}
    for topic in lacking:
        lacking[topic] = leaderless(topic)
    at_fault: dict[Partition, int] = {(topic, p): n for (topic, p), n in named.items()
                if p is not None and p in (lacking[topic] or ())}
    if at_fault:
        return at_fault, True
    return dict(named), any(answer is None for answer in lacking.values())
