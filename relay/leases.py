"""Shard leases: who publishes which keys, and the fencing tokens every write carries.

Replicas need no coordinator.  Each heartbeat a replica (1) announces itself and
counts the live replicas, (2) renews its leases by token (a lease that does not
come back was taken over: the shard is lost at once), (3) gives back shards above
its fair share once nothing of them is in flight, and (4) claims free or expired
shards up to its fair share.  Lease math that needs time takes ``now`` (monotonic
seconds) as an argument; the local lease clock is :mod:`outbox_core.leases` (the jobs
worker's too).

Shards change hands in milliseconds, not heartbeats.  A replica that gives shards
back, or that finds itself below its fair share when the count of live replicas
changed (it joined, or a peer left), tells the others (``notify_shards``, a NOTIFY);
each then runs its heartbeat at once (:meth:`LeaseManager.hurry`).  A shard being
given back with rows in flight is released as soon as they settle
(:meth:`LeaseManager.release_settled`, after every turn of the loop), not at the next
heartbeat.  Before this, a replica joining a busy relay waited two heartbeats for its
share, and the shards given back published nothing meanwhile.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from outbox_core.leases import local_deadline
from relay.model import Lease, ShardId, Token

#: The soonest a heartbeat runs again after one when a peer asks for it early.
EARLY_HEARTBEAT_GAP_S = 0.05
#: A replica left short of its share by a change of the live count looks again this soon,
#: once, in case the notice of the shards given back to it was missed.
SHORT_RECHECK_S = 0.5


def fair_share(shards: int, live_replicas: int) -> int:
    """Shards one replica should hold: the ceiling, so every shard has a taker."""
    return math.ceil(shards / max(1, live_replicas))


class LeaseStore(Protocol):
    def heartbeat(self, *, owner: str, ttl_s: float, leases: Any, lease_s: float,
                  stalled: str = "{}") -> tuple[int, dict[ShardId, Token]]: ...
    def claim_shards(self, *, owner: str, limit: int, lease_s: float,
                     held: Any = None) -> dict[ShardId, Token]: ...
    def release(self, *, owner: str, leases: Any) -> set[ShardId]: ...
    def forget_replica(self, *, owner: str) -> None: ...
    def notify_shards(self, *, owner: str) -> None: ...


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
        self._last_heartbeat = -math.inf
        self._live_seen = 0  # live replicas at the last heartbeat (0: none yet)

    def due(self, now: float) -> bool:
        return now >= self._next_heartbeat

    def next_due(self) -> float:
        return self._next_heartbeat

    @property
    def live_replicas(self) -> int:
        """Live replicas at the last heartbeat (0 before the first)."""
        return self._live_seen

    def hurry(self) -> None:
        """A peer gave shards back or wants some: run the heartbeat now (at most one
        every ``EARLY_HEARTBEAT_GAP_S``), not at its interval.  Before the first
        heartbeat there is nothing to hurry: it is due at once."""
        if self._live_seen:
            self._next_heartbeat = min(self._next_heartbeat, self._last_heartbeat + EARLY_HEARTBEAT_GAP_S)

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
        self._last_heartbeat = sent_at
        self._next_heartbeat = sent_at + self.heartbeat_s
        held = list(self.leases.values())
        change.live_replicas, renewed = self._store.heartbeat(
            owner=self.owner, ttl_s=self.lease_s, leases=held, lease_s=self.lease_s,
            stalled=self._stalled())
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
        change.released = self._release(busy_shards)

        wanted = target - len(self.leases)
        if wanted > 0:
            # Also what a previous process of this owner name left leased (a restarted
            # container): not waited out, see leases.sql's claim_shards.
            claimed = self._store.claim_shards(owner=self.owner, limit=wanted, lease_s=self.lease_s,
                                               held=sorted(self.leases))
            for shard, token in claimed.items():
                self.leases[shard] = Lease(shard, token, deadline)
                change.acquired.append(shard)
        # Peers hurry their heartbeats: to take what was given back, or to give this
        # replica its share (asked once per change of the live count, not while a share
        # stays short because the shards do not divide evenly).
        short = len(self.leases) < target and change.live_replicas != self._live_seen
        self._live_seen = change.live_replicas
        if change.released or short:
            self._store.notify_shards(owner=self.owner)
        if short:
            self._next_heartbeat = min(self._next_heartbeat, sent_at + SHORT_RECHECK_S)
        return change

    def release_settled(self, busy_shards: set[ShardId]) -> list[ShardId]:
        """Give back the shards being given back whose rows have settled, now rather than
        at the next heartbeat, and tell the peers.  Call it after a turn of the loop."""
        released = self._release(busy_shards)
        if released:
            self._store.notify_shards(owner=self.owner)
        return released

    def _release(self, busy_shards: set[ShardId]) -> list[ShardId]:
        idle = [self.leases[s] for s in sorted(self.releasing) if s not in busy_shards and s in self.leases]
        if not idle:
            return []
        released = self._store.release(owner=self.owner, leases=idle)
        for shard in released:
            self.leases.pop(shard, None)
            self.releasing.discard(shard)
        # One that did not come back had been taken over already.
        self.lose([lease.shard for lease in idle if lease.shard not in released], "release_rejected")
        return sorted(released)

    def release_all(self) -> list[ShardId]:
        """At shutdown, after the drain: give every lease back so a peer takes over at once."""
        released = self._store.release(owner=self.owner, leases=list(self.leases.values()))
        self.leases.clear()
        self.releasing.clear()
        self._store.forget_replica(owner=self.owner)
        if released:
            self._store.notify_shards(owner=self.owner)
        return sorted(released)
