"""The claim's index (issue 18): which one migrate keeps for the server and the shard count,
and how it builds it on a live outbox without holding the application's writers.

A plain ``CREATE INDEX`` takes a SHARE lock on the table: every INSERT of every writer
waits until the build ends, and the build of a partial index reads the whole table, the
published rows a long retention keeps included (minutes on a large outbox).  Until this
module, migrate built the claim's index that way, in its transaction, whatever the table's
size: the migration job of an upgrade to a release with the shard column, or of a
``--shards`` change, stopped the application's writes for as long as the build read.

So from :data:`CONCURRENTLY_FROM_BYTES` of table data on, the index is built
``CONCURRENTLY`` (on each partition, then attached, for a partitioned outbox): writers go
on, and the build waits instead for the transactions older than it to end, on a connection
of its own, its waits watched and bounded by ``--index-wait-s`` (300 s; relay/index_build.py),
migrate exiting 6 naming the sessions past it, as it does for a migration that cannot take
its locks.  Not ``--lock-timeout-s``, which bounds what a migration's lock request holds
writers up and is kept short: a job's transaction of a few minutes (a worker pool's fenced
transaction) would have failed every build.  A build that did not finish
leaves an invalid index (PostgreSQL's way), which the next run drops and builds again.  A
smaller outbox keeps the transaction's build: it holds writers for tens of milliseconds at
most, and a concurrent build would wait for every transaction in the database older than it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import psycopg
from psycopg import sql

from relay.index_build import build_concurrently
from relay.migrate_steps import MigrationBlocked, Step, bounded
from relay.partitions import is_partitioned
from relay.queries import query

#: The first PostgreSQL whose btree scans keep their order with an "= ANY" test on a later
#: column: the claim's index carries the shard from there on (admin.sql, pending_index_xid_id).
SHARD_COLUMN_SINCE = 170000
#: Migration 0001's index of the pending rows by (xid, id): the claim's before PostgreSQL 17.
XID_ID_INDEX = "outbox_pending_idx"
#: From this much table data on (a plain build reads it all, 10-100 ms on these machines),
#: the claim's index is built CONCURRENTLY (see the module).
CONCURRENTLY_FROM_BYTES = 8 << 20
#: The claim's index, as a step of migrate's.
STEP = Step("the claim's index for the shard count", None, "pending_index")
_OUTBOX = sql.Identifier("outbox")
R = TypeVar("R")


def pending_index(shards: int) -> str:
    """The claim's index for ``shards`` shards (admin.sql, pending_index_create)."""
    return f"outbox_pending_by_{int(shards)}_shards_idx"


def claim_index(server_version: int, shards: int) -> str:
    """The claim's index migrate keeps on a server of ``server_version`` (server_version_num)."""
    return pending_index(shards) if server_version >= SHARD_COLUMN_SINCE else XID_ID_INDEX


def shard_count(conn: psycopg.Connection[Any]) -> int:
    """The database's shard count (the claim's indexes are built for it)."""
    (shards,) = conn.execute(query("relay", "read_settings")).fetchone() or (16,)  # migrate makes the row
    return int(shards)


def _indexes(conn: psycopg.Connection[Any]) -> tuple[int, str, dict[str, bool]]:
    """The database's shard count, the claim's index migrate keeps for it on this server, and
    the claim's indexes there are (name: valid)."""
    shards = shard_count(conn)
    keep = claim_index(conn.info.server_version, shards)
    return shards, keep, {name: bool(valid) for name, valid in conn.execute(query("admin", "pending_indexes"))}


def report(expected: str, indexes: dict[str, bool]) -> dict[str, Any]:
    """The claim's index to keep (``expected``) and the claim's indexes there are (``found``:
    name, valid); ``ok``: the expected one, valid, and no other."""
    found = [{"name": name, "valid": valid} for name, valid in indexes.items()]
    return {"expected": expected, "found": found, "ok": found == [{"name": expected, "valid": True}]}


def state(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """:func:`report` of the claim's index migrate keeps for the server and the shard count.
    Not ok after a major upgrade to PostgreSQL 17 or a ``--shards`` change until migrate
    runs, or after a concurrent build that did not finish (`status`, and the relay's
    ``claim_index_not_built`` at start)."""
    _, expected, indexes = _indexes(conn)
    return report(expected, indexes)


def table_state(conn: psycopg.Connection[Any], table: str) -> dict[str, Any] | None:
    """:func:`state` for the outbox, relay/adopt_index.state for another ``--table`` (None:
    not a view ``migrate --debezium-table`` made)."""
    if table == "outbox":
        return state(conn)
    from relay import adopt_index  # it imports this module

    return adopt_index.state(conn, table)


def describe(found: dict[str, Any]) -> str:
    """:func:`table_state` as `status` prints it."""
    if found["ok"]:
        return str(found["expected"])
    there = ", ".join(f["name"] + ("" if f["valid"] else " (invalid: a concurrent build that did not finish)")
                      for f in found["found"]) or "none"
    if "adopted" in found:
        meanwhile = ("the claim is correct meanwhile" if any(f["valid"] for f in found["found"])
                     else "the claim reads the whole table meanwhile")
        return (f"{there}; {found['adopted']} takes {found['expected']} on this server for this shard count: "
                f"run `outbox-relay migrate` (it builds it without holding writers); {meanwhile}")
    return (f"{there}; this server and shard count take {found['expected']}: run `outbox-relay migrate` "
            "(it builds it without holding writers on a large outbox); the claim is correct meanwhile")


def statements(shards: int, block: str = "pending_index_create", *, concurrently: bool = False,
               target: sql.Composable = _OUTBOX, index: str | None = None) -> sql.Composed:
    """``block`` for ``shards`` (run with empty parameters, so that its %% is PostgreSQL's %):
    the index named ``index`` (the count's by default) on ``target``."""
    return sql.SQL(query("admin", block)).format(
        index=sql.Identifier(index or pending_index(shards)), shards=sql.Literal(int(shards)),
        concurrently=sql.SQL("CONCURRENTLY " if concurrently else ""), target=target)


def _create(shards: int, keep: str, *, concurrently: bool = False, target: sql.Composable = _OUTBOX,
            index: str | None = None) -> sql.Composed:
    """The build of ``keep`` (the count's index or 0001's), named ``index`` (``keep``) on ``target``."""
    block = "pending_index_xid_id" if keep == XID_ID_INDEX else "pending_index_create"
    return statements(shards, block, concurrently=concurrently, target=target, index=index or keep)


class _Found(NamedTuple):
    """The claim's index as migrate finds it."""

    shards: int
    keep: str  # the one for the server and the count
    valid: bool | None  # None: not there; False: a build that did not finish
    others: list[str]  # 0001's or another count's: dropped
    partitioned: bool
    heap_bytes: int


def _found(conn: psycopg.Connection[Any]) -> _Found:
    shards, keep, indexes = _indexes(conn)
    (heap_bytes,) = conn.execute(query("admin", "outbox_heap_bytes")).fetchone() or (0,)
    return _Found(shards, keep, indexes.get(keep), [n for n in indexes if n != keep], is_partitioned(conn),
                  int(heap_bytes))


def ensure(conn: psycopg.Connection[Any], dsn: str, *, lock_timeout_s: float, tries: int, log: Any,
           wait_s: float) -> None:
    """The claim's index for the database's shard count, and no other: built when missing
    (a new database, an upgrade from before it, ``--shards`` changed, a build that did not
    finish), then 0001's and other counts' dropped in a transaction under migrate's
    lock_timeout.  Before PostgreSQL 17 it is 0001's (xid, id) index (see
    :data:`SHARD_COLUMN_SINCE`); on a large outbox it is built CONCURRENTLY (see the module)."""
    def step() -> Step:
        return STEP

    now = bounded(conn, lambda: _found(conn), step=step, lock_timeout_s=lock_timeout_s, tries=tries, log=log)
    concurrently = now.valid is not True and now.heap_bytes >= CONCURRENTLY_FROM_BYTES
    if concurrently:
        build = _Build(conn, dsn, now, lock_timeout_s=lock_timeout_s, tries=tries, log=log, wait_s=wait_s)
        if now.partitioned:
            build.partitioned()
        else:
            build.plain()

    def settle() -> list[str] | None:
        """In migrate's transaction: the index built if still missing (a small outbox), the
        others dropped; what was dropped (None: nothing to do)."""
        found = _found(conn)
        if found.valid and not found.others:
            return None
        if concurrently and not found.valid:  # a partition made while its parts were built
            raise MigrationBlocked(f"{STEP.what}: partitions of the outbox were made while it was built "
                                   "CONCURRENTLY, and some have no part of it yet; run migrate again (the "
                                   "index it replaces serves the claim meanwhile)")
        if not found.valid:
            if found.valid is False:  # a concurrent build that did not finish
                _drop(conn, found.keep)
            conn.execute(_create(found.shards, found.keep), {})
        for name in found.others:
            _drop(conn, name)
        return found.others

    dropped = bounded(conn, settle, step=step, lock_timeout_s=lock_timeout_s, tries=tries, log=log)
    if log is not None and (dropped is not None or concurrently):
        log.info("pending_index_built", index=now.keep, dropped=dropped or [], concurrently=concurrently)


def _drop(conn: psycopg.Connection[Any], name: str) -> None:
    conn.execute(sql.SQL(query("admin", "drop_index")).format(index=sql.Identifier(name)))


class _Build:
    """The claim's index built CONCURRENTLY on a large outbox (see the module)."""

    def __init__(self, conn: psycopg.Connection[Any], dsn: str, found: _Found, *, lock_timeout_s: float,
                 tries: int, log: Any, wait_s: float) -> None:
        self.conn, self.dsn, self.found, self.log = conn, dsn, found, log
        self.lock_timeout_s, self.tries, self.wait_s = lock_timeout_s, tries, wait_s

    def _in_transaction(self, body: Callable[[], R]) -> R:
        return bounded(self.conn, body, step=lambda: STEP, lock_timeout_s=self.lock_timeout_s, tries=self.tries,
                       log=self.log)

    def _timed_drop(self, name: str) -> None:
        self._in_transaction(lambda: _drop(self.conn, name))

    def plain(self) -> None:
        keep = self.found.keep
        if self.found.valid is False:  # the last run's build did not finish
            self._timed_drop(keep)
        self._concurrently(_create(self.found.shards, keep, concurrently=True), table="outbox", index=keep)

    def partitioned(self) -> None:
        """The index ON ONLY the outbox (invalid), then each partition's part built
        CONCURRENTLY and attached: the index is valid once every partition's part is."""
        keep, shards = self.found.keep, self.found.shards

        self._in_transaction(lambda: self.conn.execute(
            _create(shards, keep, target=sql.SQL("ONLY {}").format(_OUTBOX)), {}))
        suffix = f"_pending_{shards}_idx" if keep != XID_ID_INDEX else "_pending_idx"
        for _ in range(3):  # a partition made meanwhile (the relay's maintenance) is seen next time
            missing = self._in_transaction(lambda: self.conn.execute(
                query("admin", "pending_index_partitions"), {"index": keep, "suffix": suffix}).fetchall())
            if not missing:
                return
            for part, child, child_valid in missing:
                if child_valid is False:
                    self._timed_drop(child)
                self._concurrently(_create(shards, keep, concurrently=True, target=sql.Identifier(part), index=child),
                                   table=part, index=child)

                attach = sql.SQL(query("admin", "attach_index")).format(
                    index=sql.Identifier(keep), child=sql.Identifier(child))
                self._in_transaction(lambda: self.conn.execute(attach))  # noqa: B023 - run at once

    def _concurrently(self, statement: sql.Composed, *, table: str, index: str) -> None:
        if self.log is not None:
            self.log.info("pending_index_building", index=index, table=table, concurrently=True)
        build_concurrently(self.conn, self.dsn, statement, table=table, index=index, step=STEP,
                           wait_s=self.wait_s, log=self.log)
