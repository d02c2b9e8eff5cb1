"""An adopted Debezium table's claim index carries the shard, as the outbox's does, and
every `migrate` keeps it for the shard count (relay/adopt_index.py).

Before: `migrate --debezium-table` built `<table>_relay_pending_idx` on (relay_xid, relay_seq)
whatever the server, and nothing built it again.  On PostgreSQL 17 and later a replica
holding some of the shards read its peers' pending rows from the table and dropped them
(the claim's shard test a filter), where the outbox's claim index has carried the shard as
a third key column since issue 18's forty-second pass; `migrate --shards` left the adopted
table's index as it was, and `status` called the old index right.  Now adopt builds
`<table>_relay_pending_by_<N>_shards_idx` from 17 on, written as the claim reads through
the view so that PostgreSQL matches it, and every `migrate` builds it for the count (and
drops the one it replaces), concurrently: the table is the application's."""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from relay import adopt_index, migrate_index
from relay.migrate_index import SHARD_COLUMN_SINCE
from relay.model import Cursor, ShardId
from relay.queries import compose
from relay.store import Store, claim_params
from tests.integration.test_debezium import DEBEZIUM_TABLE
from tests.integration.test_debezium_rerun import VALID, claim_index, migrate_cli
from tests.integration.test_status_detached import _status

VIEW = "app.outbox_events_relay"
#: A replica's shards: 4 of the 16.
HELD = [ShardId(s) for s in (0, 4, 8, 12)]


def _adopted(dsn: str, rows: int = 5000) -> int:
    """The Debezium table with ``rows`` rows of 200 keys, adopted with them pending; returns
    the server's version."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app")
        conn.execute(DEBEZIUM_TABLE)
        conn.execute("INSERT INTO app.outbox_events (id, aggregatetype, aggregateid, type, payload) "
                     "SELECT gen_random_uuid(), 'Order', 'k-' || (g %% 200), 'Changed', '{}' "
                     "FROM generate_series(1, %s) AS g", (rows,))
        version = conn.info.server_version
    migrate_cli(dsn, "--debezium-table", "app.outbox_events", "--existing", "pending")
    return version


def _claim_indexes(dsn: str) -> dict[str, bool]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return dict(conn.execute(adopt_index.blocks()["adopted_claim_indexes"],
                                 {"schema": "app", "name": "outbox_events"}).fetchall())


def _status_of_the_view(dsn: str) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(_status(dsn, "--table", VIEW, "--json").stdout)["claim_index"]
    return report


def _index_scans(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan] if plan.get("Node Type") == "Index Scan" else []
    for child in plan.get("Plans", []):
        found += _index_scans(child)
    return found


def _explain_second_claim(dsn: str) -> list[dict[str, Any]]:
    """The index scans of the relay's claim through the view, at its second batch, as a
    replica holding :data:`HELD` claims."""
    store = Store(dsn, table=VIEW)
    try:
        store.claim_shards(owner="test", limit=1 << 16, lease_s=3600)
        cursor = Cursor()
        rows, snapshot, _ = store.claim(shards=HELD, nshards=16, after=cursor, limit=500)
        assert rows
        cursor = cursor.advanced(rows[-1], snapshot or cursor.cur)
        params = claim_params(shards=HELD, nshards=16, after=cursor, limit=500, max_bytes=1_000_000,
                              budget_bytes=4 << 20, now=None)
    finally:
        store.close()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ANALYZE app.outbox_events")
        claim = compose("relay", "claim_batch", table=VIEW)
        explain = sql.SQL("EXPLAIN (FORMAT JSON) ") + (sql.SQL(claim) if isinstance(claim, str) else claim)
        ((plan,),) = conn.execute(explain, params).fetchall()
    return _index_scans(plan[0]["Plan"])


def test_the_adopted_table_s_claim_index_carries_the_shard_and_a_replica_s_claim_steps_over_its_peers(outbox_db):
    version = _adopted(outbox_db)
    expected, _ = claim_index(outbox_db)
    assert _claim_indexes(outbox_db) == {expected: True}
    scans = [s for s in _explain_second_claim(outbox_db) if s.get("Index Name") == expected]
    assert scans, "the claim through the view does not use the adopted table's claim index"
    shard_test = "& 2147483647) % 16) = ANY"
    if version >= SHARD_COLUMN_SINCE:
        assert expected == "outbox_events_relay_pending_by_16_shards_idx"
        # Before: a Filter on every pending row the scan read, the replica's peers' included.
        assert all(shard_test in s["Index Cond"] for s in scans), scans
    else:  # before 17 an "= ANY" on a later column breaks the scan's order: 0001's shape
        assert expected == "outbox_events_relay_pending_idx"
        assert any(shard_test in s.get("Filter", "") for s in scans), scans
    assert _status_of_the_view(outbox_db) == {"expected": expected, "adopted": "app.outbox_events",
                                              "found": [{"name": expected, "valid": True}], "ok": True}


def test_migrate_shards_builds_the_adopted_table_s_claim_index_for_the_new_count(outbox_db):
    version = _adopted(outbox_db)
    done = migrate_cli(outbox_db, "--shards", "32")
    with_32 = adopt_index.claim_index("outbox_events", version, 32)
    assert _claim_indexes(outbox_db) == {with_32: True}
    report = _status_of_the_view(outbox_db)
    assert report["ok"] is True and report["expected"] == with_32, report
    if version >= SHARD_COLUMN_SINCE:
        assert with_32 == "outbox_events_relay_pending_by_32_shards_idx"
        [built] = [e for e in (json.loads(x) for x in done.stdout.splitlines() if x.startswith("{"))
                   if e["event"] == "pending_index_built" and e.get("table") == "app.outbox_events"]
        assert built["dropped"] == ["outbox_events_relay_pending_by_16_shards_idx"], built
    with psycopg.connect(outbox_db, autocommit=True) as conn:  # every other index of the table kept
        assert {name for name, _ in conn.execute(VALID)} == {with_32, "outbox_events_relay_published_idx",
                                                            "outbox_events_relay_retrying_idx"}


def test_migrate_replaces_the_claim_index_a_table_was_adopted_with_before(outbox_db):
    """A table adopted before: on 17 and later, the (relay_xid, relay_seq) index adopt built
    then (on 15, where that one is kept, a shard index stands in for "the other kind")."""
    version = _adopted(outbox_db)
    kept, _ = claim_index(outbox_db)
    other = "outbox_events_relay_pending_idx" if version >= SHARD_COLUMN_SINCE else \
        "outbox_events_relay_pending_by_16_shards_idx"
    block = "pending_index" if version >= SHARD_COLUMN_SINCE else "pending_index_shards"
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier("app", kept)))
        conn.execute(sql.SQL(adopt_index.blocks()[block]).format(
            index=sql.Identifier(other), source=sql.Identifier("app", "outbox_events"), shards=sql.Literal(16)), {})
    report = _status_of_the_view(outbox_db)
    assert report == {"expected": kept, "adopted": "app.outbox_events",
                      "found": [{"name": other, "valid": True}], "ok": False}, report
    [line] = [x for x in _status(outbox_db, "--table", VIEW).stdout.splitlines() if x.startswith("claim index:")]
    assert line == (f"claim index:         {other}; app.outbox_events takes {kept} on this server for this shard "
                    "count: run `outbox-relay migrate` (it builds it without holding writers); the claim is "
                    "correct meanwhile")
    migrate_cli(outbox_db)
    assert _claim_indexes(outbox_db) == {kept: True}
    assert _status_of_the_view(outbox_db)["ok"] is True


def test_migrate_leaves_an_adopted_table_another_role_owns_and_says_so(outbox_db):
    """migrate's role may not build an index on a table it does not own (PostgreSQL's rule):
    the adopted table is left as it is, with a warning naming its owner, and the rest of
    migrate's work is done (before this warning, an InsufficientPrivilege failed the run)."""
    version = _adopted(outbox_db)
    kept, _ = claim_index(outbox_db)
    suffix = uuid.uuid4().hex[:8]
    migrator, owner = f"migrator_{suffix}", f"app_owner_{suffix}"
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(migrator)))
        conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(owner)))
        conn.execute(sql.SQL("GRANT CREATE ON SCHEMA public TO {}").format(sql.Identifier(migrator)))
        for (table,) in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'").fetchall():
            conn.execute(sql.SQL("ALTER TABLE {} OWNER TO {}").format(sql.Identifier(table), sql.Identifier(migrator)))
        conn.execute(sql.SQL("ALTER TABLE app.outbox_events OWNER TO {}").format(sql.Identifier(owner)))
    try:
        done = migrate_cli(make_conninfo(outbox_db, user=migrator), "--shards", "32")
        [skipped] = [e for e in (json.loads(x) for x in done.stdout.splitlines() if x.startswith("{"))
                     if e["event"] == "adopted_claim_index_skipped"]
        assert skipped["table"] == "app.outbox_events" and skipped["owner"] == owner, skipped
        assert _claim_indexes(outbox_db) == {kept: True}  # as it was
        report = _status_of_the_view(outbox_db)
        assert report["ok"] is (version < SHARD_COLUMN_SINCE), report  # 17 on: the count's index stands
    finally:
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            for role in (migrator, owner):
                conn.execute(sql.SQL("REASSIGN OWNED BY {} TO current_user").format(sql.Identifier(role)))
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_migrate_leaves_the_partitions_of_a_table_adopt_refused_alone(outbox_db):
    """adopt refuses a partitioned table at its concurrent builds, after its columns went in,
    so the partitions carry relay_seq and relay_xid.  Before: migrate took each partition
    for an adopted table and built a claim index on it."""
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app")
        conn.execute("CREATE TABLE app.parted (id uuid, aggregatetype text, aggregateid text NOT NULL, "
                     "type text, payload jsonb, relay_seq bigint, relay_xid xid8, relay_published_at timestamptz) "
                     "PARTITION BY HASH (aggregateid)")
        conn.execute("CREATE TABLE app.parted_0 PARTITION OF app.parted FOR VALUES WITH (MODULUS 1, REMAINDER 0)")
    migrate_cli(outbox_db)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        assert conn.execute("SELECT indexrelid::regclass::text FROM pg_index "
                            "WHERE indrelid IN ('app.parted'::regclass, 'app.parted_0'::regclass)").fetchall() == []


def test_a_role_with_no_right_on_the_adopted_table_s_schema_reads_its_claim_index(outbox_db):
    """The relay reads the claim index at start (claim_index_not_built) as its own role, which
    needs rights on the view's schema only, when the view is in another (--view).  With a
    to_regclass of the table's name, that read failed, permission denied for schema app,
    and the relay would not start."""
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app")
        conn.execute("CREATE SCHEMA relayv")
        conn.execute(DEBEZIUM_TABLE)
        version = conn.info.server_version
    migrate_cli(outbox_db, "--debezium-table", "app.outbox_events", "--view", "relayv.events")
    reader = f"reader_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(reader)))
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA relayv TO {0}; GRANT SELECT ON relayv.events, "
                             "outbox_relay_settings TO {0}").format(sql.Identifier(reader)))
    try:
        with psycopg.connect(make_conninfo(outbox_db, user=reader), autocommit=True) as conn:
            found = migrate_index.table_state(conn, "relayv.events")
        assert found == {"expected": adopt_index.claim_index("outbox_events", version, 16), "adopted": "app.outbox_events",
                         "found": [{"name": adopt_index.claim_index("outbox_events", version, 16), "valid": True}],
                         "ok": True}, found
    finally:
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {0}; DROP ROLE {0}").format(sql.Identifier(reader)))
