"""migrate builds the claim's index for the database's shard count (issue 18): the pending
rows by (xid, id, shard), so that a replica holding some of the shards steps over its
peers' rows inside the index (tests/integration/test_claim_plan.py shows the plan).  The
index carries the count in its name; migrate builds it on a new database, on an outbox
from before it, and again when --shards changes the count, and drops 0001's (xid, id)
index and any other count's; the build waits for its lock at most --lock-timeout-s, as a
migration does."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from relay import migrate

INDEXES = """
SELECT c.relname::text, pg_get_indexdef(c.oid)
FROM pg_index AS x JOIN pg_class AS c ON c.oid = x.indexrelid
WHERE x.indrelid = 'outbox'::regclass AND c.relname LIKE 'outbox_pending%%'
ORDER BY 1
"""
#: A child index of the claim's index on each partition of a partitioned outbox.
PARTITION_INDEXES = """
SELECT count(*) FILTER (WHERE i.inhparent = to_regclass(%(parent)s)),
       count(*) FILTER (WHERE i.inhparent = to_regclass('outbox_pending_idx'))
FROM pg_inherits AS i JOIN pg_index AS x ON x.indexrelid = i.inhrelid
"""
OLD_INDEX = "CREATE INDEX outbox_pending_idx ON outbox (xid, id) WHERE published_at IS NULL"


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


def _from_before(dsn: str) -> None:
    """The outbox as migrate left it before the claim's index: 0001's index only."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP INDEX {migrate.pending_index(16)}")
        conn.execute(OLD_INDEX)


def test_migrate_builds_the_index_for_the_count_and_again_when_the_count_changes(db_dsn):
    log = Events()
    migrate.apply(db_dsn, log=log)
    found = indexes(db_dsn)
    assert list(found) == ["outbox_pending_by_16_shards_idx"], found
    assert "% 16))) WHERE (published_at IS NULL)" in found["outbox_pending_by_16_shards_idx"], found
    assert ("pending_index_built", {"index": "outbox_pending_by_16_shards_idx",
                                    "dropped": ["outbox_pending_idx"]}) in log.said
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
def test_an_outbox_from_before_gets_the_index_on_upgrade(db_dsn, partitioned):
    migrate.apply(db_dsn, partitioned=partitioned)
    _from_before(db_dsn)
    assert list(indexes(db_dsn)) == ["outbox_pending_idx"]
    migrate.apply(db_dsn)
    assert list(indexes(db_dsn)) == ["outbox_pending_by_16_shards_idx"]
    if partitioned:  # each partition has its part of the new index, none of the old one
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            ((new, old),) = conn.execute(PARTITION_INDEXES,
                                         {"parent": "outbox_pending_by_16_shards_idx"}).fetchall()
            (partitions,) = conn.execute("SELECT count(*) FROM pg_inherits "
                                         "WHERE inhparent = 'outbox'::regclass").fetchone() or (0,)
        assert partitions > 0 and (new, old) == (partitions, 0)


def test_a_blocked_build_names_the_session_and_a_later_run_builds_it(db_dsn):
    migrate.apply(db_dsn)
    _from_before(db_dsn)
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
        assert list(indexes(db_dsn)) == ["outbox_pending_idx"]  # rolled back: the old one serves
    finally:
        writer.rollback()
        writer.close()
    migrate.apply(db_dsn)
    assert list(indexes(db_dsn)) == ["outbox_pending_by_16_shards_idx"]
