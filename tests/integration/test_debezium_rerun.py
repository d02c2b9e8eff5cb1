"""`migrate --debezium-table` run again repairs an index an interrupted run left unfinished.

Its indexes are built CONCURRENTLY, outside a transaction.  A build that does not finish (the
command interrupted, a lock_timeout or statement_timeout of the role cancelling its wait for
a long transaction) leaves PostgreSQL's invalid index: no query uses it, every write still
updates it.  README says to run the command again; before, its CREATE INDEX CONCURRENTLY IF
NOT EXISTS found the name taken and kept the invalid index, at every run: the claim through
the view had no index of the pending rows and read the whole table each time."""

from __future__ import annotations

import json
import subprocess

import psycopg
import pytest
from psycopg import sql

from relay import adopt_index
from relay.migrate_index import SHARD_COLUMN_SINCE
from tests.fixtures.outbox import relay_cmd
from tests.integration.test_debezium import DEBEZIUM_TABLE, debezium_table
from tests.integration.test_status_detached import _status

VIEW = "app.outbox_events_relay"

VALID = """
SELECT c.relname::text, x.indisvalid FROM pg_index AS x JOIN pg_class AS c ON c.oid = x.indexrelid
WHERE x.indrelid = 'app.outbox_events'::regclass AND c.relname LIKE 'outbox_events_relay_%%'
ORDER BY 1
"""


def migrate_cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`outbox-relay migrate --dsn DSN ARGS`, which must succeed without a traceback."""
    done = subprocess.run(relay_cmd("migrate", "--dsn", dsn, *args), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return done


def _adopt(dsn: str) -> None:
    migrate_cli(dsn, "--debezium-table", "app.outbox_events")


def claim_index(dsn: str) -> tuple[str, sql.Composed]:
    """The adopted table's claim index on this server for 16 shards, and its build."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        version = conn.info.server_version
    name = adopt_index.claim_index("outbox_events", version, 16)
    block = "pending_index_shards" if version >= SHARD_COLUMN_SINCE else "pending_index"
    return name, sql.SQL(adopt_index.blocks()[block]).format(
        index=sql.Identifier(name), source=sql.Identifier("app", "outbox_events"), shards=sql.Literal(16))


def _indexes(dsn: str) -> dict[str, bool]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return dict(conn.execute(VALID).fetchall())


def _interrupted_adoption(dsn: str) -> None:
    """An adopted table whose pending rows' index is as a run interrupted in its build
    leaves it: a writer's transaction open, the build's wait for it cut by a lock_timeout."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app")
        conn.execute(DEBEZIUM_TABLE)
        conn.execute("INSERT INTO app.outbox_events (id, aggregatetype, aggregateid, type, payload) "
                     "SELECT gen_random_uuid(), 'Order', 'k-' || (g % 50), 'Changed', '{}' "
                     "FROM generate_series(1, 1000) AS g")
    _adopt(dsn)
    assert set(_indexes(dsn).values()) == {True}
    pending, build = claim_index(dsn)
    _unfinished_build(dsn, sql.Identifier("app", "outbox_events"), pending, build)
    assert _indexes(dsn)[pending] is False


def _unfinished_build(dsn: str, table: sql.Identifier, index: str, build: sql.Composed) -> None:
    """``index`` of ``table`` dropped and built again by ``build`` (a CREATE INDEX
    CONCURRENTLY), whose wait for a writer's open transaction a lock_timeout cuts: left
    invalid, as an interrupted run leaves it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier("app", index)))
    writer = psycopg.connect(dsn)
    try:
        writer.execute(sql.SQL("INSERT INTO {} (id, aggregatetype, aggregateid, type, payload) "
                               "VALUES (gen_random_uuid(), 'Order', 'k-1', 'Changed', '{{}}')").format(table))
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '200ms'")
            with pytest.raises(psycopg.errors.LockNotAvailable):
                conn.execute(build, {})
    finally:
        writer.rollback()
        writer.close()


def test_adopting_again_builds_the_index_an_interrupted_run_left_invalid(outbox_db):
    _interrupted_adoption(outbox_db)
    _adopt(outbox_db)
    assert _indexes(outbox_db) == {claim_index(outbox_db)[0]: True,
                                   "outbox_events_relay_published_idx": True,
                                   "outbox_events_relay_retrying_idx": True}


def test_status_through_the_view_says_the_adopted_tables_index_is_unfinished(outbox_db):
    """Before: status said nothing of an adopted table's indexes (its claim index line, and
    the relay's claim_index_not_built at start, covered only the native outbox)."""
    _interrupted_adoption(outbox_db)
    pending, _ = claim_index(outbox_db)
    report = json.loads(_status(outbox_db, "--table", VIEW, "--json").stdout)["claim_index"]
    assert report == {"expected": pending, "adopted": "app.outbox_events",
                      "found": [{"name": pending, "valid": False}], "ok": False}
    [line] = [x for x in _status(outbox_db, "--table", VIEW).stdout.splitlines() if x.startswith("claim index:")]
    assert line == (f"claim index:         {pending} (invalid: a concurrent build that did not finish); "
                    f"app.outbox_events takes {pending} on this server for this shard count: run `outbox-relay "
                    "migrate` (it builds it without holding writers); the claim reads the whole table meanwhile")
    _adopt(outbox_db)
    assert json.loads(_status(outbox_db, "--table", VIEW, "--json").stdout)["claim_index"]["ok"] is True


#: 46 characters: PostgreSQL cuts its index names "<table>_relay_retrying_idx" at 63 bytes.
LONG = "outbox_events_of_the_order_fulfillment_service"


def test_adopting_again_builds_a_long_named_table_s_index_an_interrupted_run_left_invalid(outbox_db):
    """The server stores the retrying rows' index under its name cut to 63 bytes, and adopt
    asks for the whole name: the lookup of an unfinished build finds it all the same (a
    ``name`` parameter is cut as its input), and so does its DROP.  Checked when the index
    names were reviewed for long tables (no change was needed)."""
    table = sql.Identifier("app", LONG)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app")
        conn.execute(debezium_table("app", LONG))
    migrate_cli(outbox_db, "--debezium-table", f"app.{LONG}")
    retrying = f"{LONG}_relay_retrying_idx".encode()[:63].decode()
    assert len(retrying.encode()) == 63 and not retrying.endswith("_idx"), retrying
    valid = "SELECT x.indisvalid FROM pg_index AS x JOIN pg_class AS c ON c.oid = x.indexrelid WHERE c.relname = %s"
    build = sql.SQL(adopt_index.blocks()["retrying_index"]).format(retrying_index=sql.Identifier(retrying),
                                                                   source=table)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        assert conn.execute(valid, (retrying,)).fetchall() == [(True,)]
    _unfinished_build(outbox_db, table, retrying, build)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        assert conn.execute(valid, (retrying,)).fetchall() == [(False,)]
    migrate_cli(outbox_db, "--debezium-table", f"app.{LONG}")
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        assert conn.execute(valid, (retrying,)).fetchall() == [(True,)]
    # The claim's index: the table's name cut, not the count's suffix (relay/adopt_index.py).
    report = json.loads(_status(outbox_db, "--table", f"app.{LONG}_relay", "--json").stdout)["claim_index"]
    assert report["ok"] is True and report["expected"].startswith(LONG[:20]), report
    assert report["expected"].endswith(("_relay_pending_by_16_shards_idx", "_relay_pending_idx")), report
