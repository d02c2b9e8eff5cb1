"""The claim is served by the partial index on pending rows (issue 14: show the plan), a
replica's shards by its third column (issue 18).

A window's claim reads the transactions in flight at the previous snapshot by index
lookups and the later ones by one index range, never the whole pending index (whose
dead entries an open transaction keeps alive); "nothing seen" reads the whole index.
"""

from __future__ import annotations

import os

import psycopg
from psycopg import sql

from relay import migrate
from relay.migrate import pending_index
from relay.model import Cursor, ShardId
from relay.queries import compose
from relay.store import Store, claim_params
from relay.wire import text_value

SHARDS = 16
#: The claim's index migrate builds for the shard count (the outbox_db fixture's 16), on
#: PostgreSQL 17 and later; before, migration 0001's (xid, id) index (relay/migrate.py).
SHARD_INDEX = pending_index(SHARDS)


def claim_index(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return migrate.claim_index(conn.info.server_version, SHARDS)


def explain(dsn: str, cursor: Cursor, *, options: str = "", nshards: int = SHARDS,
            shards: tuple[int, ...] = (0, 1, 2)) -> list[tuple[object, ...]]:
    """EXPLAIN (with ``options``, e.g. "(ANALYZE, FORMAT JSON)") of the claim from ``cursor``."""
    params = claim_params(shards=[ShardId(s) for s in shards], nshards=nshards, after=cursor,
                          limit=1000, max_bytes=1_000_000, budget_bytes=4 << 20, now=None)
    query = compose("relay", "claim_batch")
    text = query if isinstance(query, sql.Composed) else sql.SQL(query)  # type: ignore[arg-type]
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql.SQL("EXPLAIN " + options + " ") + text, params).fetchall()


def plan(dsn: str, cursor: Cursor) -> str:
    return "\n".join(str(r[0]) for r in explain(dsn, cursor))


def test_claims_use_the_pending_index(outbox_db):
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox (topic, key, payload) SELECT 't', 'k' || g % 100, '{}' "
                     "FROM generate_series(1, 20000) AS g")
        conn.execute("UPDATE outbox SET published_at = now() WHERE id % 10 <> 0")
        conn.execute("ANALYZE outbox")
    held = psycopg.connect(outbox_db)
    try:
        held.execute("INSERT INTO outbox (topic, key, payload) VALUES ('t', 'held', '{}')")
        with psycopg.connect(outbox_db, autocommit=True) as conn:  # a later xid completes
            conn.execute("INSERT INTO outbox (topic, key, payload) VALUES ('t', 'later', '{}')")
        store = Store(outbox_db)
        try:
            rows, snapshot, _ = store.claim(shards=[ShardId(0), ShardId(1), ShardId(2)],
                                         nshards=SHARDS, after=Cursor(), limit=1000)
        finally:
            store.close()
        assert rows and snapshot is not None
        window = Cursor.after_snapshot(snapshot)
        assert window.prev_xip, snapshot  # the held transaction was in flight below xmax
        for cursor in (Cursor(), window, window.advanced(rows[-1], snapshot)):
            text = plan(outbox_db, cursor)
            assert claim_index(outbox_db) in text, text
            assert "Seq Scan on outbox" not in text, text
        text = plan(outbox_db, window)
        assert "xid = ANY" in text and "xid >= " in text, text  # the two branches
    finally:
        held.rollback()
        held.close()


def _probe_loops(dsn: str, cursor: Cursor) -> int:
    """How many times the claim's per-key back-off probe ran (the correlated SubPlan on the
    retrying index), from EXPLAIN ANALYZE."""
    [(doc,)] = explain(dsn, cursor, options="(ANALYZE, FORMAT JSON)", nshards=1, shards=(0,))

    def walk(node: dict) -> int:
        probe = node.get("Index Name") == "outbox_retrying_idx" and node.get("Parent Relationship") == "SubPlan"
        own = node.get("Actual Loops", 0) if probe else 0
        return own + sum(walk(child) for child in node.get("Plans", []))

    return walk(doc[0]["Plan"])  # type: ignore[index]


def test_rows_pay_the_back_off_probe_only_while_some_row_is_in_back_off(outbox_db):
    """A row waits while an earlier row of its key is in back-off; the per-key probe behind
    that runs only when some row is in back-off at all (asked once per claim)."""
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox (topic, key, payload) SELECT 't', k, '{}' "
                     "FROM unnest(ARRAY['a', 'a', 'b', 'c']) AS k")
        first_a = conn.execute("SELECT min(id) FROM outbox WHERE key = 'a'").fetchone()[0]
    store = Store(outbox_db)
    try:
        def claimed() -> list[str]:
            rows = store.claim(shards=[ShardId(0)], nshards=1, after=Cursor(), limit=100).rows
            return [row.key or "" for row in rows]

        assert claimed() == ["a", "a", "b", "c"]
        assert _probe_loops(outbox_db, Cursor()) == 0  # nothing in back-off: never run
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute("UPDATE outbox SET retry_at = now() + interval '1 hour', attempts = 1 "
                         "WHERE id = %s", (first_a,))
        assert claimed() == ["b", "c"]  # a's rows wait behind its first, the others do not
        assert _probe_loops(outbox_db, Cursor()) > 0
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute("UPDATE outbox SET retry_at = now() - interval '1 second' WHERE id = %s",
                         (first_a,))
        assert claimed() == ["a", "a", "b", "c"]  # the retry is due: the full pass sends it first
        # Until its mark a due row still holds its key in a window's claim (which never
        # takes it): the probe still runs, and stops once the row is published.
        assert _probe_loops(outbox_db, Cursor()) > 0
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute("UPDATE outbox SET published_at = now(), retry_at = NULL WHERE id = %s",
                         (first_a,))
        assert _probe_loops(outbox_db, Cursor()) == 0
    finally:
        store.close()


def _pending_index_pages(dsn: str, cursor: Cursor) -> int:
    """Pages of the pending index the claim from ``cursor`` read (EXPLAIN ANALYZE, BUFFERS)."""
    [(doc,)] = explain(dsn, cursor, options="(ANALYZE, BUFFERS, FORMAT JSON)", nshards=1, shards=(0,))
    index = claim_index(dsn)

    def walk(node: dict) -> int:
        own = (node.get("Shared Hit Blocks", 0) + node.get("Shared Read Blocks", 0)
               if node.get("Index Name") == index else 0)
        return own + sum(walk(child) for child in node.get("Plans", []))

    return walk(doc[0]["Plan"])  # type: ignore[index]


def test_a_windows_claim_does_not_walk_the_pending_rows_below_it(outbox_db):
    """Rows that stay pending below the window (here 30,000 in back-off, as a poison key or a
    partition down for a while leaves them; also the dead entries of rows marked since the
    last vacuum) are not the next windows' business: a claim reads the window's part of the
    index, whatever lies below it.  Its range started at the position (0, 0) and read every
    page below (on the code before the fix: 8 ms a claim with 300,000 such rows); on
    PostgreSQL 15 its lookup of the transactions in flight at the snapshot read from the
    first of them to the index's end once the position had passed them all."""
    # A transaction in flight at the window's snapshot, as a busy database always has one:
    # the window's first branch looks its rows up (prev_xip).
    in_flight = psycopg.connect(outbox_db)
    in_flight.execute("SELECT pg_current_xact_id()")
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox (topic, key, payload, retry_at, attempts) "
                     "SELECT 't', 'held-' || g % 100, '{}', now() + interval '1 hour', 1 "
                     "FROM generate_series(1, 30000) AS g")
        conn.execute("ANALYZE outbox")
    store = Store(outbox_db)
    try:
        def claim(cursor: Cursor) -> tuple[list[str], str | None]:
            rows, snapshot, _ = store.claim(shards=[ShardId(0)], nshards=1, after=cursor, limit=3)
            return [row.key or "" for row in rows], snapshot

        rewind, snapshot = claim(Cursor())
        assert rewind == [] and snapshot is not None  # every row in back-off: nothing to claim
        window = Cursor.after_snapshot(snapshot)
        assert window.prev_xip, snapshot
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute("INSERT INTO outbox (topic, key, payload) "
                         "SELECT 't', 'new-' || g, '{}' FROM generate_series(1, 5) AS g")
        # A few pages for the window's range, and a descent for each transaction in flight
        # at its snapshot (other tests' too, on a shared server); walking the rows below
        # read over a hundred.
        bound = 10 + 3 * len(window.prev_xip)
        assert _pending_index_pages(outbox_db, window) < bound
        first, cur = claim(window)
        assert first == ["new-1", "new-2", "new-3"] and cur is not None
        rows = store.claim(shards=[ShardId(0)], nshards=1, after=window, limit=3).rows
        inside = window.advanced(rows[-1], cur)  # the same window, after its third row
        assert _pending_index_pages(outbox_db, inside) < bound
        assert claim(inside)[0] == ["new-4", "new-5"]
    finally:
        store.close()
        in_flight.rollback()
        in_flight.close()


def _scans(node: dict) -> list[tuple[str, str]]:
    """(node type, relation or index) of every scan in an EXPLAIN (FORMAT JSON) plan."""
    own = [(node["Node Type"], node.get("Index Name") or node.get("Relation Name", ""))] \
        if "Scan" in node["Node Type"] else []
    return own + [scan for child in node.get("Plans", []) for scan in _scans(child)]


def test_the_claim_never_scans_the_table_after_a_back_off_episode(outbox_db):
    """Statistics taken while many rows were in back-off (a partition down for a while) last
    until the next ANALYZE, after the episode is over.  The claim's "is any row in back-off"
    probe was then planned as a scan of the whole table (the planner expecting a match
    within the first rows), and with none left it read every row the table keeps, at every
    claim: 120 ms a claim with 600,000 rows in a one-off run.  It reads the tiny index of
    rows in back-off, custom and generic plans alike."""
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("ALTER TABLE outbox SET (autovacuum_enabled = false)")  # the stale stats stay
        conn.execute("INSERT INTO outbox (topic, key, payload, retry_at, attempts) "
                     "SELECT 't', 'k' || g % 100, '{}', now() + interval '1 hour', 1 "
                     "FROM generate_series(1, 20000) AS g")
        conn.execute("ANALYZE outbox")  # taken during the episode
        conn.execute("UPDATE outbox SET published_at = now(), retry_at = NULL")  # it is over
        conn.execute("INSERT INTO outbox (topic, key, payload) VALUES ('t', 'new', '{}')")
    window = Cursor(prev_xmax=1)
    for mode in ("force_custom_plan", "force_generic_plan"):
        os.environ["PGOPTIONS"] = f"-c plan_cache_mode={mode}"
        try:
            [(doc,)] = explain(outbox_db, window, options="(ANALYZE, FORMAT JSON)", nshards=1, shards=(0,))
        finally:
            del os.environ["PGOPTIONS"]
        scans = _scans(doc[0]["Plan"])  # type: ignore[index]
        assert ("Seq Scan", "outbox") not in scans, (mode, scans)
        assert any(index == "outbox_retrying_idx" for _, index in scans), (mode, scans)


def _nodes(node: dict) -> list[dict]:
    """Every node of an EXPLAIN (FORMAT JSON) plan."""
    return [node] + [n for child in node.get("Plans", []) for n in _nodes(child)]


def test_a_replica_steps_over_its_peers_rows_inside_the_index(outbox_db):
    """A replica holding some of the shards reads its own rows from the table and steps over
    its peers' in the index, whose third column is each row's shard (issue 18).  Before it,
    the index held (xid, id) only: the claim read every shard's pending rows from the table
    and dropped its peers' by a filter (here 15 of 16), and a replica holding a quarter of
    the shards spent 2.1 times a lone relay's execution per claimed row.  Checked on the
    statement the store prepares and runs, as PostgreSQL plans it for the claim's values.
    Before PostgreSQL 17 migrate keeps the (xid, id) index: there the shard test in the
    index condition came with a sort of every matching row (65 ms for a claim of 1,000 out
    of 52,500 on PostgreSQL 15); no plan sorts the claim's rows, on any version."""
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox (topic, key, payload) SELECT 't', 'k' || g % 1600, '{}' "
                     "FROM generate_series(1, 16000) AS g")
        conn.execute("ANALYZE outbox")
        mine = conn.execute("SELECT count(*) FROM outbox WHERE (hashtext(key) & 2147483647) % 16 = 3").fetchone()[0]
    assert 0 < mine < 16000
    index = claim_index(outbox_db)
    store = Store(outbox_db)
    try:
        claimed = store.claim(shards=[ShardId(3)], nshards=SHARDS, after=Cursor(), limit=20000)
        assert len(claimed.rows) == mine and {row.shard for row in claimed.rows} == {3}
        params = claim_params(shards=[ShardId(3)], nshards=SHARDS, after=Cursor(), limit=20000,
                              max_bytes=1_000_000, budget_bytes=1 << 40, now=None)
        statement = store._claim_statement  # prepared on the store's connection by the claim
        values = sql.SQL(", ").join(sql.Literal(None if v is None else v.decode())
                                    for v in (text_value(params[name]) for name in statement._names))
        explained = sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE {}({})").format(
            sql.Identifier(statement.name.decode()), values)
        [(doc,)] = store.conn.execute(explained).fetchall()
    finally:
        store.close()
    nodes = _nodes(doc[0]["Plan"])  # type: ignore[index]
    scans = [n for n in nodes if n.get("Index Name") == index]
    assert scans, doc
    assert [n for n in nodes if n["Node Type"] == "Sort"] == [], doc
    if index == SHARD_INDEX:
        assert sum(scan["Actual Rows"] for scan in scans) == mine, scans
        assert sum(scan.get("Rows Removed by Filter", 0) for scan in scans) == 0, scans
        assert all("% 16) = ANY" in scan["Index Cond"] for scan in scans), scans
    else:  # read from the table, then filtered
        assert sum(scan.get("Rows Removed by Filter", 0) for scan in scans) == 16000 - mine, scans
