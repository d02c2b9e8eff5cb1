"""The claim's index of a table ``migrate --debezium-table`` adopted (relay/adopt.py), kept
for the server and the database's shard count as the outbox's is (relay/migrate_index.py).

Until this module, adopt built ``<table>_relay_pending_idx`` on (relay_xid, relay_seq)
whatever the server: on PostgreSQL 17 and later a replica holding some of the shards read
every peer's pending row from the table and kept its own (the claim's shard test a filter),
where the outbox's index carries the shard as a third key column (issue 18's forty-second
pass).  Now, from 17 on, the adopted table's claim index carries it too, written as the claim's
test reads through the view (debezium.sql, pending_index_shards), and named for the count:
``<table>_relay_pending_by_<N>_shards_idx``.  ``adopt`` builds it; every ``migrate`` builds it
for a table adopted before, or again after ``--shards`` changed the count, and drops the one
it replaces.  Each build is CONCURRENTLY on a connection of its own (relay/index_build.py):
the table is the application's, and its writers never wait for it.  A drop takes the
table's ACCESS EXCLUSIVE lock for an instant, in a transaction of migrate's whose wait is
bounded by ``--lock-timeout-s`` (relay/migrate_steps.py), as the outbox's old index's is.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import psycopg
from psycopg import sql

from relay.index_build import build_concurrently
from relay.migrate_index import SHARD_COLUMN_SINCE, report, shard_count
from relay.migrate_steps import Step, bounded
from relay.queries import parse_blocks, query, sql_files

#: PostgreSQL's longest name, in bytes: an index name past it would be cut, its suffix first.
NAME_BYTES = 63


@cache
def blocks() -> dict[str, str]:
    """outbox_core/sql/adopt/debezium.sql's blocks."""
    return parse_blocks((sql_files() / "adopt" / "debezium.sql").read_text(encoding="utf-8"))


def claim_index(table: str, server_version: int, shards: int) -> str:
    """The claim's index of the adopted table ``table`` (its name, without the schema) on a
    server of ``server_version`` for ``shards`` shards: the table's name cut, not the suffix,
    when the whole would pass :data:`NAME_BYTES`."""
    suffix = (f"_relay_pending_by_{int(shards)}_shards_idx" if server_version >= SHARD_COLUMN_SINCE
              else "_relay_pending_idx")
    room = NAME_BYTES - len(suffix.encode())
    while len(table.encode()) > room:
        table = table[:-1]
    return table + suffix


def _claim(conn: psycopg.Connection[Any], schema: str, table: str) -> tuple[int, str, dict[str, bool]]:
    """The database's shard count, the adopted table's claim index for it on this server, and
    the table's claim indexes there are (name: valid)."""
    shards = shard_count(conn)
    indexes = conn.execute(blocks()["adopted_claim_indexes"], {"schema": schema, "name": table})
    return shards, claim_index(table, conn.info.server_version, shards), {n: bool(v) for n, v in indexes}


def state(conn: psycopg.Connection[Any], view: str) -> dict[str, Any] | None:
    """relay/migrate_index.report for a view ``migrate --debezium-table`` made (None: ``view``
    is not one), with ``adopted``, the table under it."""
    row = conn.execute(query("admin", "adopted_table_of_view"), {"view": view}).fetchone()
    if row is None:
        return None
    adopted, schema, table = row
    _, expected, indexes = _claim(conn, schema, table)
    return {**report(expected, indexes), "adopted": adopted}


def ensure_all(conn: psycopg.Connection[Any], dsn: str, *, lock_timeout_s: float, tries: int, wait_s: float,
               log: Any) -> None:
    """:func:`ensure` for every adopted table of the database (migrate's last step); a table
    another role owns, on which migrate's may not build an index, is left as it is, with a
    warning (``adopted_claim_index_skipped``): the claim is correct meanwhile."""
    with conn.transaction():  # ended at once: the builds would wait for a transaction left open
        tables = conn.execute(blocks()["adopted_tables"]).fetchall()
    for schema, table, owner in tables:
        if owner is not None:
            if log is not None:
                log.warning("adopted_claim_index_skipped", table=f"{schema}.{table}", owner=owner,
                            detail=f"the claim's index of the adopted table {schema}.{table} is kept for the "
                                   f"shard count by a migrate run as its owner, {owner}; the claim is correct "
                                   "meanwhile (status --table names what stands)")
            continue
        ensure(conn, dsn, schema, table, lock_timeout_s=lock_timeout_s, tries=tries, wait_s=wait_s, log=log)


def ensure(conn: psycopg.Connection[Any], dsn: str, schema: str, table: str, *, lock_timeout_s: float,
           tries: int, wait_s: float, log: Any) -> None:
    """The adopted table's claim index for the server and the shard count, and no other:
    built CONCURRENTLY when missing (an unfinished build's invalid index dropped first), then
    the others dropped.  ``conn`` idle, in either autocommit mode."""
    with conn.transaction():  # ended at once, as in ensure_all
        shards, keep, there = _claim(conn, schema, table)
    if there == {keep: True}:
        return
    step = Step(f"the claim's index of the adopted table {schema}.{table}", None, "adopted_pending_index")

    def drop(index: str) -> None:
        statement = sql.SQL(query("admin", "drop_index")).format(index=sql.Identifier(schema, index))
        bounded(conn, lambda: conn.execute(statement), step=lambda: step, lock_timeout_s=lock_timeout_s,
                tries=tries, log=log)

    if there.get(keep) is not True:
        if there.get(keep) is False:  # a concurrent build that did not finish
            drop(keep)
        source = sql.Identifier(schema, table)
        block = "pending_index_shards" if conn.info.server_version >= SHARD_COLUMN_SINCE else "pending_index"
        statement = sql.SQL(blocks()[block]).format(index=sql.Identifier(keep), source=source,
                                                    shards=sql.Literal(shards))
        if log is not None:
            log.info("pending_index_building", index=keep, table=f"{schema}.{table}", concurrently=True)
        build_concurrently(conn, dsn, statement, table=source.as_string(conn), index=keep, step=step,
                           wait_s=wait_s, log=log)
    dropped = [name for name in there if name != keep]
    for name in dropped:
        drop(name)
    if log is not None:
        log.info("pending_index_built", index=keep, table=f"{schema}.{table}", dropped=dropped,
                 concurrently=True)
