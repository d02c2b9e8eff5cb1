"""The claim and the mark as prepared statements of the store's connection (relay/wire.py),
on the real SQL: the same rows as through psycopg's cursor, nothing lost when a statement
vanishes from the connection, and the statement that a connection already has is used."""

from __future__ import annotations

from datetime import UTC, datetime

import psycopg
import pytest

from relay import wire
from relay.model import Cursor, Lease, ShardId, Token
from relay.queries import query
from relay.store import Store
from tests.fixtures.outbox import insert_rows, migrated, scalar

pytestmark = pytest.mark.skipif(not wire.INTERNALS, reason="psycopg lacks the internals relay/wire.py uses")

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _cursor_store(dsn: str, **kwargs: object) -> Store:
    """A store whose claim and mark go through psycopg's cursor, as before relay/wire.py."""
    store = Store(dsn, **kwargs)  # type: ignore[arg-type]
    store.prepared_cycle = False
    return store


def _prepared(store: Store) -> set[str]:
    rows = store.conn.execute("SELECT name FROM pg_prepared_statements WHERE name LIKE 'outbox_relay_%'")
    return {name.rsplit("_", 1)[0] for (name,) in rows}


def _rows_of_every_kind(dsn: str) -> None:
    """jsonb payloads over keys, a binary payload, a tombstone, a row without a key, headers."""
    insert_rows(dsn, "orders", 12, keys=3)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox (topic, key, payload_bytes, headers) "
                     "VALUES ('orders', 'k0', '\\x00ff10'::bytea, '{\"h\": \"v\"}')")
        conn.execute("INSERT INTO outbox (topic, key) VALUES ('orders', 'k1')")
        conn.execute("INSERT INTO outbox (topic, payload) VALUES ('orders', '{\"é\": \"ü\"}')")


def test_the_claim_and_the_mark_are_prepared_and_match_the_cursor_path(db_dsn):
    dsn = migrated(db_dsn, shards=4)
    _rows_of_every_kind(dsn)
    store, reference = Store(dsn, now=T0), _cursor_store(dsn, now=T0)
    try:
        tokens = store.claim_shards(owner="A", limit=4, lease_s=3600)
        shards = sorted(tokens)
        for after, limit, budget in ((Cursor(), 100, 4 << 20), (Cursor(), 5, 4 << 20), (Cursor(), 100, 100)):
            got = store.claim(shards=shards, nshards=4, after=after, limit=limit, budget_bytes=budget)
            want = reference.claim(shards=shards, nshards=4, after=after, limit=limit, budget_bytes=budget)
            assert got.rows == want.rows and got.cut == want.cut
            assert got.snapshot is not None and want.snapshot is not None
        rows = store.claim(shards=shards[:2], nshards=4, after=Cursor(), limit=100).rows
        everything = store.claim(shards=shards, nshards=4, after=Cursor(), limit=100).rows
        assert len(everything) == 15 and {r.shard for r in rows} <= set(shards[:2])
        binary = [r for r in everything if r.value == b"\x00\xff\x10"]
        assert len(binary) == 1 and binary[0].headers_json == '{"h": "v"}'
        assert [r.value for r in everything if r.key == "k1" and r.value is None]  # the tombstone

        leases = [Lease(ShardId(s), Token(t), 0.0) for s, t in tokens.items()]
        held, marked = store.mark_published(owner="A", leases=leases, rows=everything[:4])
        assert held == set(shards) and marked == {r.id for r in everything[:4]}
        assert scalar(dsn, "SELECT count(*) FROM outbox WHERE published_at = %(t)s", {"t": T0}) == 4
        # Fenced as before: a stale token marks nothing.
        stale = [Lease(ShardId(s), Token(t - 1), 0.0) for s, t in tokens.items()]
        assert store.mark_published(owner="A", leases=stale, rows=everything[4:]) == (set(), set())

        # Input only ever goes as a value: the statements prepared are the blocks' text.
        nasty = "'; DROP TABLE outbox; --"
        assert store.mark_published(owner=nasty, leases=leases, rows=everything[4:]) == (set(), set())
        assert _prepared(store) == {"outbox_relay_claim_batch", "outbox_relay_mark_published"}
        assert _prepared(reference) == set()
        for name in ("claim_batch", "mark_published"):
            (text,) = store.conn.execute("SELECT statement FROM pg_prepared_statements WHERE name LIKE %s",
                                         (f"outbox_relay_{name}_%",)).fetchone()
            assert text == wire.positional(query("relay", name).replace("{table}", '"outbox"'))[0]
        assert scalar(dsn, "SELECT count(*) FROM outbox") == 15
    finally:
        store.close()
        reference.close()


def test_a_statement_gone_from_the_connection_is_prepared_again(db_dsn):
    """psycopg sends DEALLOCATE ALL after a rollback on the connection; a session pooler
    may hand over a server that never saw the PREPARE."""
    dsn = migrated(db_dsn, shards=1)
    insert_rows(dsn, "orders", 6, keys=2)
    store = Store(dsn)
    try:
        tokens = store.claim_shards(owner="A", limit=1, lease_s=3600)
        leases = [Lease(ShardId(s), Token(t), 0.0) for s, t in tokens.items()]
        first = store.claim(shards=[ShardId(0)], nshards=1, after=Cursor(), limit=100).rows
        store.mark_published(owner="A", leases=leases, rows=first[:2])
        store.conn.execute("DEALLOCATE ALL")
        assert _prepared(store) == set()
        again = store.claim(shards=[ShardId(0)], nshards=1, after=Cursor(), limit=100).rows
        assert again == first[2:]
        assert store.mark_published(owner="A", leases=leases, rows=again)[1] == {r.id for r in again}
        assert scalar(dsn, "SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0
        assert _prepared(store) == {"outbox_relay_claim_batch", "outbox_relay_mark_published"}
        # A failed transaction on the connection (psycopg deallocates after a rollback when
        # it prepared statements of its own there).
        with pytest.raises(psycopg.errors.DivisionByZero), store.conn.transaction():
            store.conn.execute("SELECT 1/0")
        insert_rows(dsn, "orders", 2, keys=2, start=6)
        assert len(store.claim(shards=[ShardId(0)], nshards=1, after=Cursor(), limit=100).rows) == 2
    finally:
        store.close()


def test_a_statement_the_connection_already_has_is_used(db_dsn):
    """A second statement object on the same connection (the name is taken, by the same
    text): PREPARE's duplicate-name error is not a failure."""
    dsn = migrated(db_dsn, shards=1)
    insert_rows(dsn, "orders", 3, keys=1)
    store = Store(dsn)
    try:
        store.claim(shards=[ShardId(0)], nshards=1, after=Cursor(), limit=100)
        store._claim_statement = wire.Prepared("relay", "claim_batch", table="outbox")
        assert len(store.claim(shards=[ShardId(0)], nshards=1, after=Cursor(), limit=100).rows) == 3
    finally:
        store.close()
