"""Fakes of the pump's collaborators, shared by the pump's unit tests (pure logic: no
database, no broker).  They follow the real contracts closely enough to be honest:

* ``Store``: row ``i`` was committed by transaction ``i``; a claim takes the rows of its
  window (snapshot difference: ``prev_xmax <= xid < xmax``) after its position, of the
  shards asked for, and returns the snapshot it took; a mark removes rows from pending.
* ``Publisher``: queues rows and acknowledges them on ``poll``, except those of the
  partition named ``no_leader`` (that partition has no leader: no report comes).
* ``Leases``: holds ``usable_shards``, trusted and never fenced.

And for the loop owner's tests: a fake ``Clock``, the ``Wakeup`` adapter, a ``RetryStore``
with back-off, dead letters and fencing, a ``FailingPublisher`` and ``LosingLeases``.
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

    def xmax(self, after: Cursor) -> int:
        """The claim's snapshot: every row committed so far (the window's own when continued)."""
        return int(after.cur.split(":")[1]) if after.cur else max(self.pending, default=0) + 1

    def claim(self, *, shards: Any, nshards: int, after: Cursor, limit: int,
              xmax: int | None = None, **_: Any) -> Claimed:
        """``xmax``: the snapshot's, when a subclass took it before holding rows back."""
        if xmax is None:
            xmax = self.xmax(after)
        found = sorted((r for r in self.pending.values()
                        if r.shard in shards and after.prev_xmax <= r.xid < xmax
                        and (r.xid, r.id) > (after.xid, after.id)),
                       key=lambda r: (r.xid, r.id))
        return Claimed(found[:limit], None if after.cur else f"{xmax}:{xmax}:")

    def sweep(self, *, shards: Any, nshards: int) -> tuple[int, float | None]:
        return 0, self.next_retry_s(shards=shards, nshards=nshards)  # no foreign xids

    def next_retry_s(self, *, shards: Any, nshards: int) -> float | None:
        return None  # nothing in back-off

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
                 no_leader: int | None = None) -> None:
        self.queued: list[tuple[OutboxRow, Any]] = []
        self.sent: list[RowId] = []
        self._partition_of = partition_of
        self.no_leader = no_leader

    def partition_of(self, r: OutboxRow) -> int | None:
        return self._partition_of(r)

    def send(self, r: OutboxRow, on_delivery: Any) -> Outcome | None:
        self.queued.append((r, on_delivery))
        self.sent.append(r.id)
        return None

    def poll(self, timeout_s: float) -> int:
        served = [(r, cb) for r, cb in self.queued
                  if self.no_leader is None or self.partition_of(r) != self.no_leader]
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


# -- the loop owner's fakes (tests/unit/test_loop.py): a fake clock, the wake-up
# adapter, and a store, publisher and leases with failures, back-off and fencing. ------


class Clock:
    """Monotonic time that only moves when a wait says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += max(0.0, seconds)


class Wakeup:
    """relay.wakeup.Wakeup's contract: the lock is granted unless ``grant`` is False;
    writers notify only while some relay sleeps; a wait without a notification lasts its
    whole timeout on ``clock``."""

    def __init__(self, clock: Clock, *, grant: bool = True, peer: bool = False) -> None:
        """``grant`` False: the lock is refused, held by a peer relay when ``peer`` (writers
        notify this relay too), else by writers mid-transaction."""
        self.clock = clock
        self.grant = grant
        self.peer = peer
        self.sleeping = False
        self.peer_sleeps = False
        self.notified = False
        self.waits: list[float] = []
        self.pauses: list[float] = []
        self.sleeps = 0  # times the lock was taken
        self.closed = 0

    def set_sleeping(self, sleeping: bool) -> bool:
        self.sleeping = sleeping and self.grant
        self.peer_sleeps = sleeping and not self.grant and self.peer
        self.sleeps += self.sleeping
        return self.sleeping

    def notify(self) -> None:
        """A writer commits: NOTIFY goes out only while the lock is held."""
        self.notified = self.notified or self.sleeping or (not self.grant and self.peer)

    def wait(self, timeout_s: float) -> bool:
        self.waits.append(timeout_s)
        if self.notified:
            self.notified = False
            return True
        self.clock.advance(timeout_s)
        return False

    def pause(self, timeout_s: float) -> None:
        """A wait that reads no notification (an awake relay's)."""
        self.pauses.append(timeout_s)
        self.clock.advance(timeout_s)

    def close(self) -> None:
        self.sleeping = False
        self.closed += 1


class RetryStore(Store):
    """``Store`` plus what the real queries do on failure: ``record_failure`` counts the
    attempt and keeps the row (and its key's later rows) out of claims for ``backoff_s``,
    and once due out of a window's claim until it is sent (``sent_retries``);
    ``dead_letter`` moves it; every fenced write on a shard in ``fenced`` does nothing
    (mark: the shard is missing from the held ones; the others: None/False)."""

    def __init__(self, rows: Iterable[OutboxRow], clock: Clock) -> None:
        super().__init__(rows)
        self.clock = clock
        self.not_before: dict[RowId, float] = {}
        self.failures: list[tuple[RowId, int, float, float]] = []  # (row, attempts, at, until)
        self.dead: list[tuple[RowId, str]] = []
        self.fenced: set[ShardId] = set()
        self.claims = 0

    def add(self, r: OutboxRow) -> None:
        self.pending[r.id] = r

    def next_retry_s(self, *, shards: Any, nshards: int) -> float | None:
        now = self.clock()
        ahead = [t - now for i, t in self.not_before.items()
                 if t > now and i in self.pending and self.pending[i].shard in shards]
        return min(ahead, default=None)

    def claim(self, *, shards: Any, nshards: int, after: Cursor, limit: int,
              sent_retries: Iterable[int] = (), **_: Any) -> Claimed:
        self.claims += 1
        now = self.clock()
        everything = self.pending
        xmax = self.xmax(after)  # rows held back below are committed all the same
        sent = set(sent_retries)

        def in_range(r: OutboxRow) -> bool:  # this claim would take it (the real probe's rule)
            return after.prev_xmax <= r.xid < xmax and (r.xid, r.id) > (after.xid, after.id)

        # In back-off: its retry ahead, or due and neither in this claim's range nor sent.
        waiting = [everything[i] for i, t in self.not_before.items() if i in everything
                   and (t > now or not (in_range(everything[i]) or i in sent))]

        def held_back(r: OutboxRow) -> bool:  # in back-off, or behind a row of its key that is
            return any(w.id == r.id or (w.key is not None and w.key == r.key and w.id < r.id)
                       for w in waiting)

        self.pending = {i: r for i, r in everything.items() if not held_back(r)}
        try:
            return super().claim(shards=shards, nshards=nshards, after=after, limit=limit, xmax=xmax)
        finally:
            self.pending = everything

    def mark_published(self, *, owner: str, leases: Any, rows: Any) -> tuple[set[ShardId], set[RowId]]:
        held = {lease.shard for lease in leases} - self.fenced
        _, marked = super().mark_published(owner=owner, leases=[lease for lease in leases
                                                                 if lease.shard in held],
                                           rows=[r for r in rows if r.shard in held])
        return held, marked

    def record_failure(self, *, owner: str, lease: Lease, row: OutboxRow, error: str,
                       backoff_s: float) -> int | None:
        if lease.shard in self.fenced:
            return None
        stored = self.pending[row.id]
        self.pending[row.id] = stored._replace(attempts=stored.attempts + 1)
        self.not_before[row.id] = self.clock() + backoff_s
        self.failures.append((row.id, stored.attempts + 1, self.clock(), self.not_before[row.id]))
        return stored.attempts + 1

    def dead_letter(self, *, owner: str, lease: Lease, row: OutboxRow, reason: str,
                    error: str) -> bool:
        if lease.shard in self.fenced:
            return False
        del self.pending[row.id]
        self.dead.append((row.id, reason))
        return True


class FailingPublisher(Publisher):
    """``Publisher`` whose reports for a row come from ``outcomes[row id]`` (one per send,
    then success); records when each row was sent and its dead letters."""

    def __init__(self, clock: Clock, outcomes: dict[int, list[Outcome]] | None = None) -> None:
        super().__init__()
        self.clock = clock
        self.outcomes = outcomes or {}
        self.sent_at: list[tuple[RowId, float]] = []
        self.dead_letters: list[tuple[RowId, str, str]] = []

    def send(self, r: OutboxRow, on_delivery: Any) -> Outcome | None:
        self.sent_at.append((r.id, self.clock()))
        return super().send(r, on_delivery)

    def poll(self, timeout_s: float) -> int:
        served, self.queued = self.queued, []
        for r, callback in served:
            planned = self.outcomes.get(r.id)
            callback(r, planned.pop(0) if planned else Outcome(ok=True))
        return len(served)

    def send_dead_letter(self, r: OutboxRow, *, topic: str, reason: str, error: str,
                         attempts: int) -> str | None:
        self.dead_letters.append((r.id, topic, reason))
        return None


class LosingLeases(Leases):
    """``Leases`` that record what a fenced write lost (and stop offering it)."""

    def __init__(self, shards: Iterable[int] = (0, 1)) -> None:
        super().__init__(shards)
        self.lost: list[tuple[set[ShardId], str]] = []

    def lose(self, shards: Any, why: str) -> None:
        gone = set(shards)
        self.lost.append((gone, why))
        self.usable_shards -= gone
        for shard in gone:
            self.leases.pop(shard, None)
