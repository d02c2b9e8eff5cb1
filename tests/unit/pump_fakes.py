"""Fakes of the pump's collaborators, shared by the pump's unit tests (pure logic: no
database, no broker).  They follow the real contracts closely enough to be honest:

* ``Store``: row ``i`` was committed by transaction ``i``; a claim takes the rows of its
  window (snapshot difference: ``prev_xmax <= xid < xmax``) after its position, of the
  shards asked for, and returns the snapshot it took; a mark removes rows from pending.
* ``Publisher``: queues rows and acknowledges them on ``poll``, except those of the
  partition named ``leaderless`` (that partition has no leader: no report comes).
* ``Leases``: holds ``usable_shards``, trusted and never fenced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from relay.model import Claimed, Cursor, Lease, OutboxRow, RowId, ShardId, Token
from relay.publisher import Outcome


def row(i: int, shard: int, key: str | None = None) -> OutboxRow:
    """Row ``i`` of ``shard`` (key ``key<shard>`` unless given), committed by transaction ``i``."""
    return OutboxRow(RowId(i), f"e{i}", "t", key if key is not None else f"key{shard}", b"{}", "{}",
                     i, ShardId(shard), 0, 0.0)


class Store:
    def __init__(self, rows: Iterable[OutboxRow]) -> None:
        self.pending = {r.id: r for r in rows}
        self.marked: list[RowId] = []

    def claim(self, *, shards: Any, nshards: int, after: Cursor, limit: int, **_: Any) -> Claimed:
        xmax = int(after.cur.split(":")[1]) if after.cur else max(self.pending, default=0) + 1
        found = sorted((r for r in self.pending.values()
                        if r.shard in shards and after.prev_xmax <= r.xid < xmax
                        and (r.xid, r.id) > (after.xid, after.id)),
                       key=lambda r: (r.xid, r.id))
        return Claimed(found[:limit], None if after.cur else f"{xmax}:{xmax}:")

    def restamp_foreign(self) -> int:
        return 0

    def mark_published(self, *, owner: str, leases: Any, rows: Any) -> tuple[set[ShardId], set[RowId]]:
        for r in rows:
            if self.pending.pop(r.id, None) is not None:
                self.marked.append(r.id)
        return {lease.shard for lease in leases}, {r.id for r in rows}

    def record_failure(self, **_: Any) -> int | None:
        raise AssertionError("no failures here")

    def dead_letter(self, **_: Any) -> bool:
        raise AssertionError("no failures here")


class Publisher:
    def __init__(self, partition_of: Callable[[OutboxRow], int | None] = lambda r: None,
                 leaderless: int | None = None) -> None:
        self.queued: list[tuple[OutboxRow, Any]] = []
        self.sent: list[RowId] = []
        self._partition_of = partition_of
        self.leaderless = leaderless

    def partition_of(self, r: OutboxRow) -> int | None:
        return self._partition_of(r)

    def send(self, r: OutboxRow, on_delivery: Any) -> Outcome | None:
        self.queued.append((r, on_delivery))
        self.sent.append(r.id)
        return None

    def poll(self, timeout_s: float) -> int:
        served = [(r, cb) for r, cb in self.queued
                  if self.leaderless is None or self.partition_of(r) != self.leaderless]
        self.queued = [(r, cb) for r, cb in self.queued if (r, cb) not in served]
        for r, callback in served:
            callback(r, Outcome(ok=True))
        return len(served)

    def recreate(self) -> None: ...

    def send_dead_letter(self, *_: Any, **__: Any) -> str | None:
        return None


class Leases:
    owner = "me"

    def __init__(self, shards: Iterable[int] = (0, 1)) -> None:
        self.usable_shards = {ShardId(s) for s in shards}
        self.leases = {s: Lease(s, Token(1), 1e12) for s in self.usable_shards}

    def usable(self, now: float) -> list[Lease]:
        return [self.leases[s] for s in sorted(self.usable_shards)]

    def trusted(self, shard: ShardId, now: float) -> bool:
        return True

    def lose(self, shards: Any, why: str) -> None:
        raise AssertionError("nothing is fenced here")


class Log:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None
