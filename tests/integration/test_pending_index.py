"""migrate builds the claim's index for the database's shard count (issue 18): the pending
rows by (xid, id, shard), so that a replica holding some of the shards steps over its
peers' rows inside the index (tests/integration/test_claim_plan.py shows the plan).  The
index carries the count in its name; migrate builds it on a new database, on an outbox
from before it, and again when --shards changes the count, and drops 0001's (xid, id)
index and any other count's; the build waits for its lock at most --lock-timeout-s, as a
migration does.  Before PostgreSQL 17 the claim's index stays 0001's, and migrate puts it
back where another one stands (relay/migrate.py, SHARD_COLUMN_SINCE; the CI's second tier
runs these tests on PostgreSQL 15)."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay import migrate

INDEXES = """
SELECT c.relname::text, pg_get_indexdef(c.oid)
FROM pg_index AS x JOIN pg_class AS c ON c.oid = x.indexrelid
WHERE x.indrelid = 'outbox'::regclass AND c.relname LIKE 'outbox_pending%%'
ORDER BY 1
"""
#: A child index of the claim's index on each partition of a partitioned outbox.
PARTITION_INDEXES = """
SELECT count(*) FILTER (WHERE i.inhparent = to_regclass(%(kept)s)),
       count(*) FILTER (WHERE i.inhparent <> to_regclass(%(kept)s))
FROM pg_inherits AS i JOIN pg_index AS x ON x.indexrelid = i.inhrelid
JOIN pg_class AS c ON c.oid = i.inhparent
WHERE c.relname LIKE 'outbox_pending%%'
"""
OLD_INDEX = "CREATE INDEX outbox_pending_idx ON outbox (xid, id) WHERE published_at IS NULL"
SHARD_INDEX_16 = ("CREATE INDEX outbox_pending_by_16_shards_idx ON outbox (xid, id, "
                  "((hashtext(coalesce(key, event_id::text)) & 2147483647) % 16)) WHERE published_at IS NULL")


class Events:
    """migrate's log: the events it said, by name."""

    def __init__(self) -> None:
        self.said: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.said.append((event, fields))

    warning = info


def indexes(dsn: str) -> dict[str, str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return dict(conn.execute(INDEXES).fetchall())


def shard_column(dsn: str) -> bool:
    """The server is PostgreSQL 17 or later: the claim's index carries the shard."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.info.server_version >= migrate.SHARD_COLUMN_SINCE


def _the_other_index(dsn: str) -> str:
    """The outbox with the other kind of claim index than migrate keeps on this server (on
    17 and later, as migrate left it before the shard column: 0001's index only); returns
    the name migrate keeps."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        kept = migrate.claim_index(conn.info.server_version, 16)
        conn.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier(kept)))
        conn.execute(OLD_INDEX if kept != migrate.XID_ID_INDEX else SHARD_INDEX_16)
    return kept


def test_migrate_builds_the_index_for_the_count_and_again_when_the_count_changes(db_dsn):
    log = Events()
    migrate.apply(db_dsn, log=log)
    found = indexes(db_dsn)
    if not shard_column(db_dsn):  # before 17: 0001's index, nothing built, whatever the count
        assert list(found) == ["outbox_pending_idx"], found
        migrate.apply(db_dsn, shards=32)
        assert indexes(db_dsn) == found
        assert [e for e, _ in log.said if e == "pending_index_built"] == []
        return
    assert list(found) == ["outbox_pending_by_16_shards_idx"], found
    assert "% 16))) WHERE (published_at IS NULL)" in found["outbox_pending_by_16_shards_idx"], found
    assert ("pending_index_built", {"index": "outbox_pending_by_16_shards_idx",
                                    "dropped": ["outbox_pending_idx"], "concurrently": False}) in log.said
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox (topic, key, payload) SELECT 't', 'k' || g, '{}' "
                     "FROM generate_series(1, 500) AS g")
    again = Events()
    migrate.apply(db_dsn, log=again)  # nothing to do: nothing built, nothing said
    assert indexes(db_dsn) == found
    assert [e for e, _ in again.said if e == "pending_index_built"] == []

    migrate.apply(db_dsn, shards=32)
    found = indexes(db_dsn)
    assert list(found) == ["outbox_pending_by_32_shards_idx"], found
    assert "% 32))) WHERE (published_at IS NULL)" in found["outbox_pending_by_32_shards_idx"], found
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("SET enable_seqscan = off")  # the new index holds every pending row
        (pending,) = conn.execute("SELECT count(*) FROM outbox WHERE published_at IS NULL "
                                  "AND xid >= '0'::xid8").fetchone() or (0,)
    assert pending == 500


@pytest.mark.parametrize("partitioned", [False, True])
def test_the_other_index_gives_way_to_the_one_for_the_server_on_upgrade(db_dsn, partitioned):
    """On 17 and later: an outbox from before the shard column gets it; before 17, a shard
    index (a database moved back, one built by hand) gives way to 0001's."""
    migrate.apply(db_dsn, partitioned=partitioned)
    kept = _the_other_index(db_dsn)
    assert kept not in indexes(db_dsn)
    migrate.apply(db_dsn)
    assert list(indexes(db_dsn)) == [kept]
    if partitioned:  # each partition has its part of the kept index, none of the other
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            ((mine, other),) = conn.execute(PARTITION_INDEXES, {"kept": kept}).fetchall()
            (partitions,) = conn.execute("SELECT count(*) FROM pg_inherits "
                                         "WHERE inhparent = 'outbox'::regclass").fetchone() or (0,)
        assert partitions > 0 and (mine, other) == (partitions, 0)


def test_a_blocked_build_names_the_session_and_a_later_run_builds_it(db_dsn):
    migrate.apply(db_dsn)
    kept = _the_other_index(db_dsn)
    before = list(indexes(db_dsn))
    writer = psycopg.connect(db_dsn)
    try:
        writer.execute("SET application_name = 'slow-writer'")
        writer.execute("INSERT INTO outbox (topic, payload) VALUES ('orders', '{}')")  # stays open
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                migrate.apply(db_dsn, lock_timeout_s=0.2, tries=2)
            except migrate.MigrationBlocked as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        thread.join(30)
        assert not thread.is_alive()
        message = str(outcome.get("error"))
        assert message.startswith("the claim's index for the shard count could not take its table locks"), message
        assert "slow-writer" in message, message
        assert list(indexes(db_dsn)) == before  # rolled back: the other one still serves
    finally:
        writer.rollback()
        writer.close()
    migrate.apply(db_dsn)
    assert list(indexes(db_dsn)) == [kept]
