"""Marks on two connections (``--mark-connections``, relay/mark_lanes.py's MarkLanes, issue 18).

A draining relay with two mark connections (`--mark-connections 2`; one by default) splits each
large batch's mark between them by shard.
What must hold, on a real PostgreSQL and broker: both connections mark, every row reaches
the broker once and in key order, and a key's rows are marked in the order they were
claimed (its marks never run on two connections at once): what is marked of a key is always
a prefix, so a crash re-sends a suffix of it.
"""

from __future__ import annotations

import psycopg
import pytest

from tests.fixtures.broker import read_all
from tests.fixtures.outbox import (
    RelayThread,
    all_event_ids,
    check_delivery,
    insert_rows,
    wait_drained,
)

# Each mark of a row, with the connection and the transaction (one mark statement) that ran
# it and a number drawn when the trigger ran: of two transactions that never overlap, the
# later one draws only numbers above the earlier one's.
AUDIT = """
CREATE TABLE mark_audit (id bigint, key text, app text, tx bigint DEFAULT txid_current(), seq bigserial);
CREATE FUNCTION audit_mark() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO mark_audit (id, key, app) VALUES (NEW.id, NEW.key, current_setting('application_name'));
  RETURN NULL;
END $$;
CREATE TRIGGER audit_mark AFTER UPDATE OF published_at ON outbox FOR EACH ROW
  WHEN (OLD.published_at IS NULL AND NEW.published_at IS NOT NULL) EXECUTE FUNCTION audit_mark();
"""

# The first mark connection made slow: each of its statements sleeps before it marks.  Its
# shards then stay marking while later batches come, the split between the connections is
# off, and shards move to the second one while their earlier mark is still running: the
# moment when the second connection must wait for the first (without that wait, a moved
# shard's later rows were marked during the first connection's sleep, before its earlier
# rows).
SLOW_FIRST_LANE = """
CREATE FUNCTION slow_mark() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_sleep(0.02);
  RETURN NULL;
END $$;
CREATE TRIGGER slow_mark BEFORE UPDATE OF published_at ON outbox FOR EACH STATEMENT
  WHEN (current_setting('application_name') LIKE '%:mark') EXECUTE FUNCTION slow_mark();
"""


@pytest.mark.parametrize("slow_first_lane", [False, True], ids=["even", "slow_first_lane"])
def test_a_backlog_is_marked_on_both_connections_each_key_in_claim_order(outbox_db, broker, topic,
                                                                         slow_first_lane):
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(AUDIT)
        if slow_first_lane:
            conn.execute(SLOW_FIRST_LANE)
    insert_rows(outbox_db, topic, 30_000, keys=50, per_tx=3_000)
    expected = all_event_ids(outbox_db)
    with RelayThread(outbox_db, broker.bootstrap, batch_size=500, owner="lanes", mark_connections=2) as relay:
        wait_drained(outbox_db, timeout_s=180)
    assert relay.relay.fatal is None
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        by_app = dict(conn.execute("SELECT app, count(*) FROM mark_audit GROUP BY app").fetchall())
        # Every row marked once; both connections took a real share of the backlog.
        assert sum(by_app.values()) == 30_000, by_app
        assert set(by_app) == {"outbox-relay:lanes:mark", "outbox-relay:lanes:mark2"}, by_app
        assert min(by_app.values()) >= 3_000, by_app
        # Per key, in id order (one writer transaction per 3,000 rows: the claim's (xid, id)
        # order is id order), each mark transaction began after the one before it ended: the
        # key was never marking on both connections at once, and its marks kept claim order.
        overlapping = conn.execute("""
            WITH tx AS (SELECT tx, min(seq) AS first, max(seq) AS last FROM mark_audit GROUP BY tx),
                 k AS (SELECT key, tx, lag(tx) OVER (PARTITION BY key ORDER BY id) AS tx_before
                       FROM mark_audit)
            SELECT k.key, a.tx, b.tx FROM k JOIN tx AS a ON a.tx = k.tx_before JOIN tx AS b ON b.tx = k.tx
            WHERE k.tx <> k.tx_before AND NOT a.last < b.first""").fetchall()
        assert overlapping == []
        # Some keys did move from one connection to the other between two marks (else the
        # check above had nothing to check).
        moved = conn.execute("""
            SELECT count(DISTINCT key) FROM (
                SELECT key, app, lag(app) OVER (PARTITION BY key ORDER BY id) AS app_before
                FROM mark_audit) AS m
            WHERE app <> app_before""").fetchone()
        assert moved is not None and moved[0] > 0, moved
    delivery = check_delivery(read_all(broker.bootstrap, topic, expected=expected, timeout_s=90), expected)
    assert not delivery.missing and not delivery.order_violations
    assert delivery.duplicates == 0
