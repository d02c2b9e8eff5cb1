"""Lease math and the lease manager's decisions, with a fake store and a fake clock."""

from __future__ import annotations

from outbox_core.leases import local_deadline, safety_margin_s
from relay.leases import SHORT_RECHECK_S, LeaseManager, fair_share
from relay.model import Lease, ShardId, Token


def test_fair_share_covers_every_shard() -> None:
    assert fair_share(16, 1) == 16
    assert fair_share(16, 3) == 6
    assert fair_share(16, 16) == 1
    assert fair_share(4, 10) == 1
    for replicas in range(1, 20):
        assert fair_share(16, replicas) * replicas >= 16


def test_local_deadline_is_earlier_than_the_database_expiry() -> None:
    assert local_deadline(100.0, 10.0) == 100.0 + 10.0 - safety_margin_s(10.0)
    assert safety_margin_s(10.0) == 1.0
    assert safety_margin_s(2.0) == 0.2


class FakeLeaseStore:
    """Leases in a dict, with the same rules as the SQL: tokens grow on claim."""

    def __init__(self, shards: int) -> None:
        self.table: dict[int, tuple[str | None, float, int]] = {s: (None, 0.0, 0) for s in range(shards)}
        self.now = 0.0
        self.replicas: dict[str, float] = {}
        self.notices: list[str] = []  # notify_shards, by sender

    def heartbeat(self, *, owner: str, ttl_s: float, leases, lease_s: float, stalled: str = "{}"):
        self.replicas[owner] = self.now + ttl_s
        live = sum(1 for until in self.replicas.values() if until > self.now)
        return live, self._renew(owner=owner, leases=leases, lease_s=lease_s)

    def _renew(self, *, owner, leases, lease_s):
        out = {}
        for lease in leases:
            o, _, token = self.table[lease.shard]
            if o == owner and token == lease.token:
                self.table[lease.shard] = (o, self.now + lease_s, token)
                out[ShardId(lease.shard)] = Token(token)
        return out

    def claim_shards(self, *, owner, limit, lease_s, held=None):
        out = {}
        for shard, (o, until, token) in sorted(self.table.items()):
            if len(out) >= limit:
                break
            if o is None or until <= self.now:
                self.table[shard] = (owner, self.now + lease_s, token + 1)
                out[ShardId(shard)] = Token(token + 1)
        return out

    def release(self, *, owner, leases):
        out = set()
        for lease in leases:
            o, _, token = self.table[lease.shard]
            if o == owner and token == lease.token:
                self.table[lease.shard] = (None, 0.0, token)
                out.add(ShardId(lease.shard))
        return out

    def forget_replica(self, *, owner):
        self.replicas.pop(owner, None)

    def notify_shards(self, *, owner):
        self.notices.append(owner)


def manager(store: FakeLeaseStore, owner: str, clock) -> LeaseManager:
    return LeaseManager(store, owner=owner, shards=len(store.table), lease_s=10.0, heartbeat_s=3.0,
                        clock=clock)


def test_two_replicas_split_the_shards_and_a_third_joins() -> None:
    store = FakeLeaseStore(8)
    clock = lambda: store.now  # noqa: E731
    a, b = manager(store, "a", clock), manager(store, "b", clock)
    assert a.run_once(set()).acquired == [ShardId(s) for s in range(8)]
    # b joins: a sees two live replicas at its next heartbeat and gives back half.
    b.run_once(set())
    assert b.leases == {}
    store.now = 3.0
    change = a.run_once(set())
    assert sorted(change.released) == [4, 5, 6, 7]
    b.run_once(set())
    assert sorted(b.leases) == [4, 5, 6, 7]
    c = manager(store, "c", clock)
    store.now = 6.0
    c.run_once(set())
    a.run_once(set()), b.run_once(set()), c.run_once(set())
    held = [len(m.leases) for m in (a, b, c)]
    assert sum(held) == 8 and max(held) <= 3


def test_busy_shards_are_not_given_back_until_their_rows_settle() -> None:
    store = FakeLeaseStore(4)
    clock = lambda: store.now  # noqa: E731
    a, b = manager(store, "a", clock), manager(store, "b", clock)
    a.run_once(set())
    b.run_once(set())
    change = a.run_once({ShardId(3), ShardId(2)})
    assert change.released == []
    assert a.releasing == {2, 3}
    assert [lease.shard for lease in a.usable(store.now)] == [0, 1]  # no new claims for 2, 3
    assert a.run_once(set()).released == [2, 3]


def test_a_taken_over_lease_is_lost_at_the_next_renewal() -> None:
    store = FakeLeaseStore(2)
    clock = lambda: store.now  # noqa: E731
    lost: list[tuple[int, str]] = []
    a = LeaseManager(store, owner="a", shards=2, lease_s=10.0, heartbeat_s=3.0, clock=clock,
                     on_lost=lambda shard, why: lost.append((shard, why)))
    a.run_once(set())
    store.now = 11.0  # a was paused past its lease
    assert a.usable(store.now) == []  # it stops trusting the lease locally first
    b = manager(store, "b", clock)
    store.replicas.pop("a")
    b.run_once(set())
    assert sorted(b.leases) == [0, 1] and all(lease.token == 2 for lease in b.leases.values())
    change = a.run_once(set())
    assert sorted(change.lost) == [0, 1] and {why for _, why in lost} == {"renewal_rejected"}


def test_usable_excludes_expired_and_releasing_leases() -> None:
    store = FakeLeaseStore(3)
    m = manager(store, "a", lambda: 0.0)
    m.leases = {ShardId(0): Lease(ShardId(0), Token(1), 5.0), ShardId(1): Lease(ShardId(1), Token(1), 20.0),
                ShardId(2): Lease(ShardId(2), Token(1), 20.0)}
    m.releasing = {ShardId(2)}
    assert [lease.shard for lease in m.usable(10.0)] == [1]
    assert m.trusted(ShardId(2), 10.0) and not m.trusted(ShardId(0), 10.0)


def test_a_joiner_gets_its_share_at_once_not_at_the_holders_next_heartbeat() -> None:
    # Nothing moves the clock: every step below is driven by a notice, as the relays'
    # LISTEN connections deliver them (relay/app.py hurries the heartbeat on one).
    store = FakeLeaseStore(8)
    clock = lambda: store.now  # noqa: E731
    a, b = manager(store, "a", clock), manager(store, "b", clock)
    a.run_once(set())
    assert store.notices == []  # a lone replica at its share says nothing
    store.now = 1.0
    assert b.run_once(set()).acquired == []
    assert store.notices == ["b"]  # below its share after the live count changed
    assert b.next_due() == 1.0 + SHORT_RECHECK_S  # and it looks again soon, once
    assert not a.due(store.now)  # its next heartbeat is at 3.0
    a.hurry()
    assert a.due(store.now)
    change = a.run_once({ShardId(7)})  # shard 7 has rows in flight
    assert change.released == [4, 5, 6]
    assert store.notices == ["b", "a"]
    b.hurry()
    assert not b.due(store.now)  # not sooner than EARLY_HEARTBEAT_GAP_S after its last
    store.now += 0.05
    assert b.due(store.now)
    assert b.run_once(set()).acquired == [4, 5, 6]
    assert a.release_settled({ShardId(7)}) == []  # still in flight: kept, no notice
    assert store.notices == ["b", "a"]
    assert a.release_settled(set()) == [7]  # settled: given back at once
    assert store.notices == ["b", "a", "a"] and a.releasing == set()
    b.hurry()
    store.now += 0.05
    assert b.due(store.now)
    assert b.run_once(set()).acquired == [7]
    assert sorted(a.leases) == [0, 1, 2, 3] and sorted(b.leases) == [4, 5, 6, 7]
    assert a.release_settled(set()) == []  # nothing being given back: no statement


def test_uneven_shares_do_not_keep_asking() -> None:
    # 16 shards over 3 replicas: shares of 6 leave one replica at 4 for good; it asks once
    # (when the live count changed), not at every heartbeat.
    store = FakeLeaseStore(16)
    clock = lambda: store.now  # noqa: E731
    replicas = [manager(store, owner, clock) for owner in "abc"]
    for _ in range(4):
        for m in replicas:
            m.run_once(set())
        store.now += 3.0
    assert sorted(len(m.leases) for m in replicas) == [4, 6, 6]
    asked = len(store.notices)
    for _ in range(5):
        for m in replicas:
            m.run_once(set())
        store.now += 3.0
    assert len(store.notices) == asked


def test_a_stopping_replica_tells_its_peers_and_a_lost_release_is_a_lost_lease() -> None:
    store = FakeLeaseStore(4)
    clock = lambda: store.now  # noqa: E731
    lost: list[tuple[int, str]] = []
    a = LeaseManager(store, owner="a", shards=4, lease_s=10.0, heartbeat_s=3.0, clock=clock,
                     on_lost=lambda shard, why: lost.append((shard, why)))
    a.hurry()  # before the first heartbeat: it is due anyway
    assert a.next_due() == 0.0
    a.run_once(set())
    a.hurry()  # right after one: not sooner than EARLY_HEARTBEAT_GAP_S
    assert not a.due(store.now + 0.01) and a.due(store.now + 0.05)
    b = manager(store, "b", clock)
    b.run_once(set())
    store.now = 3.0
    a.run_once({ShardId(2), ShardId(3)})
    assert a.releasing == {2, 3}
    store.table[3] = ("b", 13.0, 9)  # taken over meanwhile (an expired lease, a paused a)
    assert a.release_settled(set()) == [2]
    assert lost == [(3, "release_rejected")] and ShardId(3) not in a.leases
    notices = len(store.notices)
    assert a.release_all() == [0, 1]
    assert store.notices[notices:] == ["a"]
