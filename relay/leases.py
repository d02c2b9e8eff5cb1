"""Shard leases: who publishes which keys, and the fencing tokens every write carries.

Replicas need no coordinator.  Each heartbeat a replica (1) announces itself and
counts the live replicas, (2) renews its leases by token (a lease that does not
come back was taken over: the shard is lost at once), (3) gives back shards above
its fair share once nothing of them is in flight, and (4) claims free or expired
shards up to its fair share.  Lease math that needs time takes ``now`` (monotonic
seconds) as an argument; the local lease clock is :mod:`outbox_core.leases` (the jobs
worker's too).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from outbox_core.leases import local_deadline
from relay.model import Lease, ShardId, Token


def fair_share(shards: int, live_replicas: int) -> int:
    """Shards one replica should hold: the ceiling, so every shard has a taker."""
    return math.ceil(shards / max(1, live_replicas))


class LeaseStore(Protocol):
    def heartbeat_replica(self, *, owner: str, ttl_s: float, stalled: str = "{}") -> int: ...
    def renew(self, *, owner: str, leases: Any, lease_s: float) -> dict[ShardId, Token]: ...
    def claim_shards(self, *, owner: str, limit: int, lease_s: float) -> dict[ShardId, Token]: ...
    def release(self, *, owner: str, leases: Any) -> set[ShardId]: ...
    def forget_replica(self, *, owner: str) -> None: ...


@dataclass(slots=True)
class LeaseChange:
    acquired: list[ShardId] = field(default_factory=list)
    lost: list[ShardId] = field(default_factory=list)
    released: list[ShardId] = field(default_factory=list)
    live_replicas: int = 1


class LeaseManager:
    """This replica's view of its leases.  Driven by the pump's thread."""

    def __init__(
        self,
        store: LeaseStore,
        *,
        owner: str,
        shards: int,
        lease_s: float,
        heartbeat_s: float,
        clock: Callable[[], float],
        on_lost: Callable[[ShardId, str], None] = lambda shard, why: None,
        stalled: Callable[[], str] = lambda: "{}",
    ) -> None:
        """``stalled``: what this replica waits on, as JSON, for the heartbeat to publish."""
        self._stalled = stalled
        self._store = store
        self.owner = owner
        self.shards = shards
        self.lease_s = lease_s
        self.heartbeat_s = heartbeat_s
        self._clock = clock
        self._on_lost = on_lost
        self.leases: dict[ShardId, Lease] = {}
        self.releasing: set[ShardId] = set()
        self._next_heartbeat = 0.0

    def due(self, now: float) -> bool:
        return now >= self._next_heartbeat

    def next_due(self) -> float:
        return self._next_heartbeat

    def usable(self, now: float) -> list[Lease]:
        """Leases this replica may produce under right now (trusted and not being given back)."""
        return [lease for lease in self.leases.values()
                if lease.deadline_monotonic > now and lease.shard not in self.releasing]

    def trusted(self, shard: ShardId, now: float) -> bool:
        lease = self.leases.get(shard)
        return lease is not None and lease.deadline_monotonic > now

    def lose(self, shards: Iterable[ShardId], why: str) -> None:
        """Forget leases a write found fenced; the pump stops producing for them at once."""
        for shard in shards:
            if self.leases.pop(shard, None) is not None:
                self.releasing.discard(shard)
                self._on_lost(shard, why)

    def run_once(self, busy_shards: set[ShardId]) -> LeaseChange:
        """One heartbeat.  ``busy_shards`` have rows in flight and are not given back yet."""
        change = LeaseChange()
        sent_at = self._clock()
        self._next_heartbeat = sent_at + self.heartbeat_s
        change.live_replicas = self._store.heartbeat_replica(owner=self.owner, ttl_s=self.lease_s,
                                                             stalled=self._stalled())

        held = list(self.leases.values())
        renewed = self._store.renew(owner=self.owner, leases=held, lease_s=self.lease_s)
        deadline = local_deadline(sent_at, self.lease_s)
        for lease in held:
            if renewed.get(lease.shard) == lease.token:
                self.leases[lease.shard] = Lease(lease.shard, lease.token, deadline)
            else:
                change.lost.append(lease.shard)
        self.lose(change.lost, "renewal_rejected")

        target = fair_share(self.shards, change.live_replicas)
        surplus = len(self.leases) - target
        if surplus > 0:
            # Give back the highest-numbered shards, after their in-flight rows settle.
            self.releasing = set(sorted(self.leases, reverse=True)[:surplus])
        else:
            self.releasing = set()
        idle = [self.leases[s] for s in sorted(self.releasing) if s not in busy_shards]
        if idle:
            released = self._store.release(owner=self.owner, leases=idle)
            for shard in released:
                self.leases.pop(shard, None)
                self.releasing.discard(shard)
                change.released.append(shard)

        wanted = target - len(self.leases)
        if wanted > 0:
            claimed = self._store.claim_shards(owner=self.owner, limit=wanted, lease_s=self.lease_s)
            for shard, token in claimed.items():
                self.leases[shard] = Lease(shard, token, deadline)
                change.acquired.append(shard)
        return change

    def release_all(self) -> list[ShardId]:
        """At shutdown, after the drain: give every lease back so a peer takes over at once."""
        released = self._store.release(owner=self.owner, leases=list(self.leases.values()))
        self.leases.clear()
        self.releasing.clear()
        self._store.forget_replica(owner=self.owner)
        return sorted(released)
