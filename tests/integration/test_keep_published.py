"""``--keep-published false``: acknowledged rows are deleted instead of marked (issue 18).

The same guarantees as marking: every row reaches the broker, in key order, and a
stale owner's delete is fenced (removes nothing)."""

from __future__ import annotations

from relay.model import Cursor, Lease, ShardId, Token
from relay.store import Store
from tests.fixtures.broker import read_all
from tests.fixtures.outbox import (
    RelayThread,
    all_event_ids,
    check_delivery,
    insert_rows,
    migrated,
    scalar,
    wait_drained,
)


def test_every_row_is_published_in_key_order_and_the_table_ends_empty(outbox_db, broker, topic):
    insert_rows(outbox_db, topic, 3000, keys=37, per_tx=250)
    expected = all_event_ids(outbox_db)
    with RelayThread(outbox_db, broker.bootstrap, batch_size=400, keep_published="false") as relay:
        wait_drained(outbox_db, timeout_s=120)
    # Read once the relay stopped: the pump counts a delete when it collects it, a moment
    # after the mark thread committed it (the table can be empty before the count is 3000).
    published = relay.metrics.registry.get_sample_value(
        "outbox_relay_events_published_total", {"topic": topic})
    assert published == 3000
    assert scalar(outbox_db, "SELECT count(*) FROM outbox") == 0  # deleted, not marked
    delivery = check_delivery(read_all(broker.bootstrap, topic, expected=3000, timeout_s=60), expected)
    assert delivery.missing == set()
    assert delivery.order_violations == []


def test_a_stale_owner_deletes_nothing(db_dsn):
    dsn = migrated(db_dsn, shards=1)
    insert_rows(dsn, "orders", 3, keys=1)
    store = Store(dsn, keep_published=False)
    try:
        assert store.claim_shards(owner="A", limit=1, lease_s=60) == {ShardId(0): Token(1)}
        rows, _, _ = store.claim(shards=[ShardId(0)], nshards=1, after=Cursor(), limit=10)
        held, deleted = store.mark_published(owner="A", leases=[Lease(ShardId(0), Token(7), 0)],
                                             rows=rows)
        assert held == set() and deleted == set()
        assert scalar(dsn, "SELECT count(*) FROM outbox") == 3
        held, deleted = store.mark_published(owner="A", leases=[Lease(ShardId(0), Token(1), 0)],
                                             rows=rows[:2])
        assert held == {ShardId(0)} and deleted == {rows[0].id, rows[1].id}
        assert scalar(dsn, "SELECT count(*) FROM outbox") == 1
        assert scalar(dsn, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL") == 0
    finally:
        store.close()
