"""The pump's cursor is only gapless for shards every claim since its start included.

A shard left out of a claim (being given back, lease briefly untrusted) has pending
rows behind the cursor; when it comes back, the pump must rewind before claiming it,
or the key's later rows go first.  Pure logic: the store, producer and leases are fakes.
"""

from __future__ import annotations

from typing import Any

from relay.metrics import RelayMetrics
from relay.model import Claimed, Cursor, Lease, OutboxRow, RowId, ShardId, Token
from relay.publisher import Outcome
from relay.pump import Pump


def row(i: int, shard: int) -> OutboxRow:
    return OutboxRow(RowId(i), f"e{i}", "t", f"key{shard}", b"{}", "{}", i, ShardId(shard), 0, 0.0)


class Store:
    def __init__(self, rows: list[OutboxRow]) -> None:
        self.pending = {r.id: r for r in rows}

    def claim(self, *, shards: Any, nshards: int, after: Cursor, limit: int,
              **_: Any) -> Claimed:
        # Every row is committed at once: one window, after which nothing is new.
        if after.prev_xmax:
            return Claimed([], None if after.cur else "100:100:")
        found = sorted((r for r in self.pending.values()
                        if r.shard in shards and (r.xid, r.id) > (after.xid, after.id)),
                       key=lambda r: (r.xid, r.id))
        return Claimed(found[:limit], None if after.cur else "100:100:")

    def restamp_foreign(self) -> int:
        return 0

    def mark_published(self, *, owner: str, leases: Any, rows: Any) -> tuple[set[ShardId], set[RowId]]:
        for r in rows:
            self.pending.pop(r.id, None)
        return {lease.shard for lease in leases}, {r.id for r in rows}

    def record_failure(self, **_: Any) -> int | None:
        raise AssertionError("no failures here")

    def dead_letter(self, **_: Any) -> bool:
        raise AssertionError("no failures here")


class Publisher:
    def __init__(self) -> None:
        self.queued: list[tuple[OutboxRow, Any]] = []
        self.sent: list[RowId] = []

    def send(self, r: OutboxRow, on_delivery: Any) -> Outcome | None:
        self.queued.append((r, on_delivery))
        self.sent.append(r.id)
        return None

    def poll(self, timeout_s: float) -> int:
        queued, self.queued = self.queued, []
        for r, callback in queued:
            callback(r, Outcome(ok=True))
        return len(queued)

    def partition_of(self, r: OutboxRow) -> int | None:
        return None

    def recreate(self) -> None: ...

    def send_dead_letter(self, *_: Any, **__: Any) -> str | None:
        return None


class Leases:
    owner = "me"

    def __init__(self) -> None:
        self.usable_shards = {ShardId(0), ShardId(1)}
        self.leases = {s: Lease(s, Token(1), 1e9) for s in self.usable_shards}

    def usable(self, now: float) -> list[Lease]:
        return [self.leases[s] for s in sorted(self.usable_shards)]

    def trusted(self, shard: ShardId, now: float) -> bool:
        return True

    def lose(self, shards: Any, why: str) -> None:
        raise AssertionError("nothing is fenced here")


class Log:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def test_a_shard_that_comes_back_is_claimed_from_the_start() -> None:
    # Shard 1's key has rows 2 and 4; shard 0's rows 1 and 3.
    store = Store([row(1, 0), row(2, 1), row(3, 0), row(4, 1)])
    publisher, leases = Publisher(), Leases()
    pump = Pump(store=store, publisher=publisher, leases=leases, nshards=2, batch_size=1,  # type: ignore[arg-type]
                pipeline_depth=1, max_attempts=3, backoff_initial_s=0.1, backoff_max_s=1.0,
                metrics=RelayMetrics(), log=Log())
    pump.run_once()                        # claims row 1 (shard 0)
    leases.usable_shards = {ShardId(0)}    # shard 1 is being given back
    pump.run_once()                        # settles row 1; claims row 3: the cursor passes row 2
    assert publisher.sent == [1, 3]
    leases.usable_shards = {ShardId(0), ShardId(1)}  # kept after all
    for _ in range(6):
        pump.run_once()
    shard1 = [i for i in publisher.sent if i in (2, 4)]
    assert shard1 == [2, 4], publisher.sent
    assert not store.pending
