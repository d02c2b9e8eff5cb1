"""The claim is served by the partial index on pending rows (issue 14: show the plan).

A window's claim reads the transactions in flight at the previous snapshot by index
lookups and the later ones by one index range, never the whole pending index (whose
dead entries an open transaction keeps alive); "nothing seen" reads the whole index.
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from relay.model import Cursor, ShardId
from relay.queries import compose
from relay.store import Store

SHARDS = 16


def explain(dsn: str, cursor: Cursor, *, options: str = "", nshards: int = SHARDS,
            shards: tuple[int, ...] = (0, 1, 2)) -> list[tuple[object, ...]]:
    """EXPLAIN (with ``options``, e.g. "(ANALYZE, FORMAT JSON)") of the claim from ``cursor``."""
    params = {"cur": cursor.cur, "prev_xmax": str(cursor.prev_xmax),
              "prev_xip": [str(x) for x in cursor.prev_xip], "nshards": nshards,
              "shards": list(shards), "all_shards": len(shards) == nshards, "after_xid": str(cursor.xid),
              "after_id": cursor.id, "limit": 1000, "now": None, "max_bytes": 1_000_000,
              "budget_bytes": 4 << 20}
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
            assert "outbox_pending_idx" in text, text
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
        assert claimed() == ["a", "a", "b", "c"]  # the retry is due: the key goes on, in order
        assert _probe_loops(outbox_db, Cursor()) == 0
    finally:
        store.close()
