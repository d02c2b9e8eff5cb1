"""Plain data of the relay (no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, NewType

ShardId = NewType("ShardId", int)
Token = NewType("Token", int)
RowId = NewType("RowId", int)


class OutboxRow(NamedTuple):
    """A pending row as claimed; ``value`` is what goes to Kafka (None = tombstone).

    A named tuple, not a dataclass: the claim makes one per row straight from the
    database's tuple (``OutboxRow._make``), where a frozen dataclass's ``__init__`` was
    an eighth of the relay's CPU in a drain."""

    id: RowId
    event_id: str
    topic: str
    key: str | None
    value: bytes | None
    headers_json: str | None  # None: not fetched (a row over the producer's limit, see size)
    xid: int
    shard: ShardId
    attempts: int
    created_epoch: float
    #: the message's bytes (payload, key, headers); above the producer's limit ``value`` was
    #: not fetched, nor ``key`` or ``headers_json`` when it is a quarter of that limit or more
    size: int = 0


class Claimed(NamedTuple):
    """What one claim found: rows in (xid, id) order; the window's snapshot when the claim
    took it; whether the byte budget cut the batch short (more rows may follow at once)."""

    rows: list[OutboxRow]
    snapshot: str | None = None
    cut: bool = False


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where the next claim starts: a window of commits and a position inside it.

    The window holds the rows that committed after the previous window's snapshot
    (given as its xmax ``prev_xmax`` and the transactions it saw in flight,
    ``prev_xip``; ``prev_xmax`` 0 means nothing seen yet: every pending row) and are
    visible in ``cur`` (a ``pg_snapshot`` as text; None: the next claim takes the
    current one).  ``(xid, id)`` is the last row claimed inside the window.
    """

    xid: int = 0
    id: int = 0
    prev_xmax: int = 0
    prev_xip: tuple[int, ...] = ()
    cur: str | None = None

    def advanced(self, row: OutboxRow, cur: str | None) -> Cursor:
        """The same window, after ``row``."""
        return Cursor(row.xid, row.id, self.prev_xmax, self.prev_xip, cur)

    @staticmethod
    def after_snapshot(snapshot: str | None) -> Cursor:
        """The window of what commits after ``snapshot`` (None: nothing seen)."""
        if snapshot is None:
            return START
        _xmin, xmax, xip = snapshot.split(":")
        return Cursor(prev_xmax=int(xmax),
                      prev_xip=tuple(int(x) for x in xip.split(",") if x))

    @property
    def fresh(self) -> bool:
        """Nothing seen: the next claim takes every pending row."""
        return self.prev_xmax == 0 and self.xid == 0 and self.id == 0


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

    claims: int = 0  # claim statements run (none in a turn whose claim was not due)
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
        self.claims += other.claims
        self.claimed += other.claimed
        self.produced += other.produced
        self.acked += other.acked
        self.marked += other.marked
        self.failed += other.failed
        self.dead_lettered += other.dead_lettered
        self.fenced += other.fenced
        self.order_violations += other.order_violations
        self.errors.extend(other.errors)
