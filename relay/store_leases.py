"""The store's lease statements: heartbeats, shard claims and releases, the owner lock.

:class:`LeaseStatements` is a part of :class:`relay.store.Store` (one connection, owned
by the pump's thread); the lease logic that uses it is relay/leases.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from relay.db import int_array
from relay.model import Lease, ShardId, Token


class LeaseStatements:
    """The lease statements of :class:`relay.store.Store`, on its connection."""

    if TYPE_CHECKING:  # the store's (relay/store.py)
        now: Any

        def _fetch(self, group: str, name: str, params: dict[str, Any]) -> list[dict[str, Any]]: ...

    def heartbeat(self, *, owner: str, ttl_s: float, leases: Sequence[Lease], lease_s: float,
                  stalled: str = "{}") -> tuple[int, dict[ShardId, Token]]:
        """One heartbeat in one statement: announce this replica (and, as JSON, the
        partitions it waits on) and renew ``leases`` by token.  Returns the number of live
        replicas (itself included) and the leases renewed, shard to token: a lease missing
        there was taken over by another replica."""
        (row,) = self._fetch("leases", "heartbeat", {
            "owner": owner, "ttl_s": ttl_s, "now": self.now, "stalled": stalled, "lease_s": lease_s,
            "shards": int_array(lease.shard for lease in leases),
            "tokens": int_array(lease.token for lease in leases),
        })
        renewed = {ShardId(shard): Token(token) for shard, token in zip(row["shards"], row["tokens"], strict=True)}
        return max(1, int(row["live"])), renewed

    def forget_replica(self, *, owner: str) -> None:
        self._fetch("leases", "forget_replica", {"owner": owner})

    def notify_shards(self, *, owner: str) -> None:
        self._fetch("leases", "notify_shards", {"owner": owner})

    def take_owner_lock(self, owner: str) -> bool:
        """The owner name's advisory lock (leases.sql): False while another live process
        runs under the same name."""
        (row,) = self._fetch("leases", "take_owner_lock", {"owner": owner})
        return bool(row["sole"])

    def claim_shards(self, *, owner: str, limit: int, lease_s: float,
                     held: Sequence[ShardId] | None = None) -> dict[ShardId, Token]:
        """Free or expired shards; with ``held`` (the shards this process holds), also the
        ones a previous process of the same owner name left leased (see leases.sql)."""
        if limit <= 0:
            return {}
        rows = self._fetch("leases", "claim_shards", {
            "owner": owner, "limit": limit, "lease_s": lease_s, "now": self.now,
            "reclaim": held is not None, "held": int_array(held or ()),
        })
        return {ShardId(r["shard"]): Token(r["token"]) for r in rows}

    def release(self, *, owner: str, leases: Sequence[Lease]) -> set[ShardId]:
        if not leases:
            return set()
        rows = self._fetch("leases", "release_shards", {
            "owner": owner, "shards": int_array(lease.shard for lease in leases),
            "tokens": int_array(lease.token for lease in leases),
        })
        return {ShardId(r["shard"]) for r in rows}

    def shard_table(self) -> list[dict[str, Any]]:
        return self._fetch("leases", "shard_table", {"now": self.now})
