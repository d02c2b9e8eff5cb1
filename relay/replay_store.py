"""The PostgreSQL side of replays: named queries of ``sql/queries/replay.sql``.

A :class:`~relay.store.Store` (same connection handling and error translation at the
seam), with the replay statements on top; it imports no driver itself.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from relay.model import OutboxRow, RowId, ShardId, Token
from relay.store import Store

#: A replay's rate bounds (``replay --rate``): 1e308 was stored and overflowed every relay's
#: token bucket; 1e-300 was a replay that never sent a row and stayed active for ever.
MIN_REPLAY_RATE = 0.001
MAX_REPLAY_RATE = 1_000_000.0

@dataclass(frozen=True, slots=True)
class Position:
    """Where a replay stands in a shard: the last acknowledged row, in first-publication
    order ``(published_at, xid, id)``; all None before the first row."""

    published_at: datetime | None = None
    xid: str | None = None
    row_id: int | None = None


@dataclass(frozen=True, slots=True)
class ReplayRow:
    """A retained row to republish, as an OutboxRow (headers carry ``replay_id``) and its position."""

    row: OutboxRow
    position: Position


@dataclass(frozen=True, slots=True)
class Fence:
    """What ``advance_progress`` found: the lease held, the replay active, the position written."""

    held: bool
    active: bool
    written: bool


def with_replay_header(headers_text: str | None, replay_id: int) -> str:
    """The row's JSON headers with ``replay_id`` added (kept as they are if not an object:
    the publisher then reports them as bad headers)."""
    try:
        headers = json.loads(headers_text or "{}")
    except ValueError:
        return headers_text or "{}"
    if not isinstance(headers, dict):
        return headers_text or "{}"
    headers["replay_id"] = str(replay_id)
    return json.dumps(headers, separators=(",", ":"))


def _value(payload_text: str | None, payload_bytes: bytes | None) -> bytes | None:
    if payload_bytes is not None:
        return bytes(payload_bytes)
    return payload_text.encode() if payload_text is not None else None


class ReplayStore(Store):
    """Replay requests and per-shard progress.  Not thread-safe: one owner thread."""

    def active_replays(self) -> list[dict[str, Any]]:
        return self._fetch("replay", "list_replays", {"active_only": True, "limit": 1000})

    def list_replays(self, *, limit: int = 100) -> list[dict[str, Any]]:
        return self._fetch("replay", "list_replays", {"active_only": False, "limit": limit})

    def create(self, *, since: datetime, until: datetime | None, topics: Sequence[str],
               keys: Sequence[str], rate: float, requested_by: str | None) -> dict[str, Any]:
        (row,) = self._fetch("replay", "create_replay", {
            "since": since, "until": until, "topics": list(topics), "keys": list(keys),
            "rate": rate, "requested_by": requested_by})
        return row

    def dry_run(self, *, since: datetime, until: datetime | None, topics: Sequence[str],
                keys: Sequence[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(rows per topic selected, the retained range of published rows)."""
        per_topic = self._fetch("replay", "dry_run", {
            "since": since, "until": until, "topics": list(topics), "keys": list(keys)})
        (retained,) = self._fetch("replay", "retained_range", {})
        return per_topic, retained

    def cancel(self, replay_id: int) -> bool:
        return bool(self._fetch("replay", "cancel_replay", {"replay_id": replay_id}))

    def load_progress(self, replay_id: int,
                      shards: Sequence[ShardId]) -> dict[ShardId, tuple[Position, bool]]:
        rows = self._fetch("replay", "load_progress", {"replay_id": replay_id, "shards": list(shards)})
        return {ShardId(r["shard"]): (Position(r["published_at"], r["xid"], r["row_id"]), bool(r["done"]))
                for r in rows}

    def batch(self, *, replay_id: int, shard: ShardId, nshards: int, after: Position,
              limit: int, budget_bytes: int) -> list[ReplayRow]:
        """The next rows after ``after``: at most ``limit``, and only until the one whose
        message crosses ``budget_bytes`` (the first row always); each row's ``size`` set."""
        rows = self._fetch("replay", "replay_batch", {
            "replay_id": replay_id, "shard": shard, "nshards": nshards, "limit": limit,
            "budget_bytes": budget_bytes,
            "after_published_at": after.published_at, "after_xid": after.xid,
            "after_id": after.row_id})
        return [ReplayRow(OutboxRow(id=RowId(r["id"]), event_id=r["event_id"], topic=r["topic"],
                                    key=r["key"], value=_value(r["payload_text"], r["payload_bytes"]),
                                    headers_json=with_replay_header(r["headers_text"], replay_id),
                                    xid=int(r["xid"]), shard=shard, attempts=0,
                                    created_epoch=float(r["created_epoch"]), size=int(r["size"])),
                          Position(r["published_at"], r["xid"], r["id"]))
                for r in rows]

    def advance(self, *, replay_id: int, shard: ShardId, owner: str, token: Token,
                start: Position, to: Position, sent: int, done: bool) -> Fence:
        """Fenced: move the replay's position in ``shard`` from ``start`` to ``to``."""
        (row,) = self._fetch("replay", "advance_progress", {
            "replay_id": replay_id, "shard": shard, "owner": owner, "token": token,
            "published_at": to.published_at, "xid": to.xid, "row_id": to.row_id,
            "from_id": start.row_id, "sent": sent, "done": done})
        return Fence(bool(row["held"]), bool(row["active"]), bool(row["written"]))

    def finish(self, *, replay_id: int, nshards: int) -> bool:
        return bool(self._fetch("replay", "finish_replay", {"replay_id": replay_id, "nshards": nshards}))
