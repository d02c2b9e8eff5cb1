"""The claim's byte budget on the real SQL: rows in (xid, id) order until the one whose
message (payload, key and headers) crosses the budget (that row included), a row over the
producer's limit counted at the limit and claimed without its payload, and ``cut`` set only when the budget, not
the row limit, ended the batch.  The expected batches are computed here from the rows'
sizes, not by the claim's own query, so a change of the window's frame or order shows."""

from __future__ import annotations

import psycopg

from relay.model import Cursor
from relay.store import Store
from tests.fixtures.outbox import migrated

#: Binary payloads (stored and sent as they are, so a row's size is its byte count).
SIZES = [300, 200, 500, 100, 2_000, 400, 50, 700, 100, 100]
MAX_BYTES = 1_000


def _expected(sizes: list[int], budget: int, limit: int) -> tuple[list[int], bool]:
    """Indexes into ``sizes`` of the first claim's rows, and whether the budget cut it."""
    taken: list[int] = []
    running = 0
    for i, size in enumerate(sizes[:limit]):
        if running >= budget:
            return taken, True
        running += min(size, MAX_BYTES)
        taken.append(i)
    return taken, False


def test_the_byte_budget_ends_a_batch_after_the_row_that_crosses_it(db_dsn):
    dsn = migrated(db_dsn, shards=4)
    with psycopg.connect(dsn, autocommit=True) as conn:
        ids = [conn.execute("INSERT INTO outbox (topic, key, payload_bytes) VALUES ('orders', %s, %s) "
                            "RETURNING id", (f"k{i % 3}", bytes([i]) * size)).fetchone()[0]  # type: ignore[index]
               for i, size in enumerate(SIZES)]
        # Each message also carries its key (two bytes) and its headers ({}, as stored).
        (headers,) = conn.execute("SELECT DISTINCT pg_column_size(headers) FROM outbox").fetchone()  # type: ignore[misc]
    sizes = [size + 2 + headers for size in SIZES]
    store = Store(dsn)
    try:
        shards = sorted(store.claim_shards(owner="A", limit=4, lease_s=3600))
        for budget in (1, 299, 300, 501, 1_000, 1_001, 2_100, 4_000, 10_000):
            for limit in (3, 6, len(SIZES)):
                claimed = store.claim(shards=shards, nshards=4, after=Cursor(), limit=limit,
                                      max_bytes=MAX_BYTES, budget_bytes=budget)
                taken, cut = _expected(sizes, budget, limit)
                assert [r.id for r in claimed.rows] == [ids[i] for i in taken], (budget, limit)
                assert claimed.cut == cut, (budget, limit)
                for row, i in zip(claimed.rows, taken, strict=True):
                    assert row.size == sizes[i]
                    assert row.value == (None if sizes[i] > MAX_BYTES else bytes([i]) * SIZES[i])
    finally:
        store.close()
