"""Daily partitions of a partitioned outbox: create the coming days, drop the past ones.

A past day's partition is dropped whole once its upper bound is older than the
retention and no row in it is unpublished, so retention costs no row deletes and
leaves no bloat.  Partition names (``outbox_pYYYYMMDD``) are composed with
:class:`psycopg.sql.Identifier`, bounds with :class:`psycopg.sql.Literal`.
DDL waits at most a short lock timeout and is retried at the next run.  A drop
locks the partition (and the parent, as DETACH does) before it checks for
unpublished rows, all in one transaction, so no row committed meanwhile is lost.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql

from relay.queries import query

_NAME = re.compile(r"^outbox_p(\d{8})$")
DAYS_AHEAD = 7
#: A detached partition's unpublished rows are counted up to this many (its pending index).
DETACHED_COUNT_CAP = 1_000_000


@dataclass
class PartitionReport:
    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    kept_pending: list[str] = field(default_factory=list)
    lock_missed: list[str] = field(default_factory=list)
    blocked_by_default: list[str] = field(default_factory=list)
    default_rows: int = 0
    #: Tables named as the outbox's daily partitions but not attached to it (a DBA's DETACH
    #: PARTITION), with their unpublished rows (counted up to DETACHED_COUNT_CAP; None: not
    #: counted, its lock not granted in time).  Those rows are no longer in the outbox and
    #: are never published.
    detached: dict[str, int | None] = field(default_factory=dict)
    #: Those of them this role may not read (SELECT refused): not counted, named apart.
    unreadable: list[str] = field(default_factory=list)

    @property
    def detached_pending(self) -> dict[str, int | None]:
        """The detached tables holding unpublished rows (or not counted, their lock not
        granted in time); the unreadable ones are not among them."""
        return {name: n for name, n in self.detached.items() if n != 0 and name not in self.unreadable}


def partition_name(day: date) -> str:
    return f"outbox_p{day:%Y%m%d}"


def partition_day(name: str) -> date | None:
    match = _NAME.match(name)
    return datetime.strptime(match.group(1), "%Y%m%d").date() if match else None


def is_partitioned(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute(query("partitions", "is_partitioned")).fetchone()
    return bool(row and row[0])


def _ddl(name: str, partition: str, **literals: Any) -> sql.Composed:
    return sql.SQL(query("partitions", name)).format(
        partition=sql.Identifier(partition), **{k: sql.Literal(v) for k, v in literals.items()})


def droppable(day: date, *, now: datetime, retention_s: float) -> bool:
    """A day's partition may go once its whole range is older than the retention."""
    upper = datetime.combine(day + timedelta(days=1), datetime.min.time(), tzinfo=UTC)
    return upper <= now - timedelta(seconds=retention_s)


def maintain(conn: psycopg.Connection[Any], *, retention_s: float | None,
             now: datetime | None = None, days_ahead: int = DAYS_AHEAD) -> PartitionReport:
    """Create partitions from yesterday (unless past the retention already) to ``days_ahead``
    days on; drop droppable ones.

    ``conn`` must be in autocommit mode.
    """
    now = now or datetime.now(UTC)
    report = PartitionReport()
    existing = {r[0] for r in conn.execute(query("partitions", "list_partitions"))}
    report.detached, report.unreadable = detached(conn)
    for offset in range(-1, days_ahead + 1):
        day = (now + timedelta(days=offset)).date()
        name = partition_name(day)
        if name in existing or name in report.detached:
            # A detached one's name is taken: CREATE TABLE IF NOT EXISTS skipped it, and it was
            # reported created at every run while the day's rows went to outbox_default.
            continue
        if retention_s is not None and droppable(day, now=now, retention_s=retention_s):
            # Yesterday under a retention shorter than a day: made now, it would be dropped
            # at the next run and made again at the one after, each time under a lock on
            # the whole outbox that writers queue behind.
            continue
        lo = datetime.combine(day, datetime.min.time(), tzinfo=UTC)
        if _try(conn, [_ddl("create_partition", name, lo=lo, hi=lo + timedelta(days=1)),
                       functools.partial(_mark_room, conn, name)],
                name, report):
            report.created.append(name)
    if retention_s is not None:
        for name in sorted(existing):
            past = partition_day(name)
            if past is not None and droppable(past, now=now, retention_s=retention_s):
                _drop_if_published(conn, name, report)
    row = conn.execute(query("partitions", "default_partition_rows")).fetchone()
    report.default_rows = int(row[0]) if row else 0
    return report


def detached(conn: psycopg.Connection[Any], *, bounded: bool = True
             ) -> tuple[dict[str, int | None], list[str]]:
    """Tables of the outbox's schema named as its daily partitions, not attached to it,
    with their unpublished rows counted (a short lock wait; None when not granted); and
    those of them this role may not read (None too): one such table is reported, the
    others are counted and maintenance goes on.  ``bounded`` False: each count one
    statement, waiting for its lock like any read (`status`, which must work through a
    statement pooler: the lock wait's bound needs a transaction block)."""
    found: dict[str, int | None] = {}
    unreadable: list[str] = []
    for (name,) in conn.execute(query("partitions", "detached_partitions")).fetchall():
        try:
            found[name] = _count_pending(conn, name, bounded=bounded)
        except psycopg.errors.LockNotAvailable:
            found[name] = None
        except psycopg.errors.InsufficientPrivilege:
            # A role without SELECT on it (the least-privilege role: grants on the parent do
            # not cover a detached table): this raised out of maintain, and the relay turned
            # partition maintenance off with a warning about creating partitions.
            found[name] = None
            unreadable.append(name)
        except psycopg.errors.UndefinedTable:
            continue  # dropped since it was listed
    return found, unreadable


def _count_pending(conn: psycopg.Connection[Any], name: str, *, bounded: bool) -> int:
    """A detached table's unpublished rows; ``bounded``: under the short lock wait."""
    with conn.transaction() if bounded else contextlib.nullcontext():
        if bounded:
            conn.execute(query("partitions", "short_lock_timeout"))
        row = conn.execute(_ddl("detached_pending", name), {"cap": DETACHED_COUNT_CAP}).fetchone()
    return int(row[0]) if row else 0


def _mark_room(conn: psycopg.Connection[Any], partition: str) -> None:
    """Give a new partition's primary key and event_id index the room migration 0015 gives
    the plain outbox's (a partitioned index takes no fillfactor of its own)."""
    for schema, index in conn.execute(query("partitions", "mark_room_indexes"), {"partition": partition}).fetchall():
        conn.execute(sql.SQL(query("partitions", "mark_room")).format(index=sql.Identifier(schema, index)))


class _Pending(Exception):
    """Rolls back a drop whose partition still holds an unpublished row."""


def _drop_if_published(conn: psycopg.Connection[Any], name: str, report: PartitionReport) -> None:
    """Lock, check, detach and drop in ONE transaction: the check and the DETACH cannot be
    separated, so a row committed into the partition meanwhile is never dropped."""

    def check() -> None:
        row = conn.execute(_ddl("partition_has_pending", name)).fetchone()
        if row and row[0]:
            raise _Pending

    try:
        if _try(conn, [_ddl("lock_for_drop", name), check, _ddl("detach_partition", name),
                       _ddl("drop_partition", name)], name, report):
            report.dropped.append(name)
    except _Pending:
        report.kept_pending.append(name)


def _try(conn: psycopg.Connection[Any], steps: list[sql.Composed | Callable[[], None]],
         name: str, report: PartitionReport) -> bool:
    """Run ``steps`` in one transaction under the short lock timeout; False (rolled back)
    when a lock was not granted in time or outbox_default holds rows of that day."""
    try:
        with conn.transaction():
            conn.execute(query("partitions", "short_lock_timeout"))
            for step in steps:
                if callable(step):
                    step()
                else:
                    conn.execute(step)
        return True
    except psycopg.errors.LockNotAvailable:
        report.lock_missed.append(name)
        return False
    except psycopg.errors.CheckViolation:
        # Rows of that day already sit in outbox_default (maintenance did not run in
        # time): they are relayed as usual and deleted row by row by the cleanup.
        report.blocked_by_default.append(name)
        return False
    except (psycopg.errors.DuplicateTable, psycopg.errors.UniqueViolation, psycopg.errors.UndefinedTable):
        # Another maintainer (a replica's cleanup, the daily `cleanup`, a second `migrate
        # --partitioned`) created or dropped it since this one listed the partitions: its
        # CREATE ... IF NOT EXISTS raced and raised, which ended the relay's cleanup thread
        # (an audit of the relay's operation).  Theirs is done: nothing to do here.
        return False
