"""Plain data of the relay (no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

ShardId = NewType("ShardId", int)
Token = NewType("Token", int)
RowId = NewType("RowId", int)


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """A pending row as claimed; ``value`` is what goes to Kafka (None = tombstone)."""

    id: RowId
    event_id: str
    topic: str
    key: str | None
    value: bytes | None
    headers_json: str
    xid: int
    shard: ShardId
    attempts: int
    created_epoch: float


@dataclass(frozen=True, slots=True)
class Cursor:
    """Position in (xid, id) order after which the next claim starts."""

    xid: int = 0
    id: int = 0

    @staticmethod
    def after(row: OutboxRow) -> Cursor:
        return Cursor(row.xid, row.id)


START = Cursor()


@dataclass(frozen=True, slots=True)
class Lease:
    """A shard lease as this replica believes it holds it.

    ``deadline_monotonic`` is the local monotonic time after which the replica
    must assume the lease may be gone (the renewal time plus the lease duration,
    minus a safety margin); it stops producing for the shard from then on.
    """

    shard: ShardId
    token: Token
    deadline_monotonic: float


@dataclass(slots=True)
class BatchResult:
    """What one run of the pump did; tests and metrics read it."""

    claimed: int = 0
    produced: int = 0
    acked: int = 0
    marked: int = 0
    failed: int = 0
    dead_lettered: int = 0
    fenced: int = 0
    order_violations: int = 0
    errors: list[str] = field(default_factory=list)

    def add(self, other: BatchResult) -> None:
        self.claimed += other.claimed
        self.produced += other.produced
        self.acked += other.acked
        self.marked += other.marked
        self.failed += other.failed
        self.dead_lettered += other.dead_lettered
        self.fenced += other.fenced
        self.order_violations += other.order_violations
        self.errors.extend(other.errors)
