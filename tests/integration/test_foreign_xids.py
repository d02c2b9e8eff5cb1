"""Rows whose xid is not this cluster's are relayed, in id order within their key (issue 14).

pg_dump/restore or logical replication from another cluster copies the `xid` column: such
a row names a transaction of the other cluster.  An xid above every xid assigned here,
or one that this cluster aborted, is detected and re-stamped with one of this cluster's;
no window would ever hold it otherwise.
"""

from __future__ import annotations

import json

import psycopg

from tests.fixtures.broker import read_all
from tests.fixtures.outbox import RelayThread, all_event_ids, wait_drained


def aborted_xids(dsn: str, n: int) -> list[int]:
    """xids of this cluster whose transactions rolled back."""
    found = []
    with psycopg.connect(dsn) as conn:
        for _ in range(n):
            found.append(int(conn.execute("SELECT pg_current_xact_id()::text").fetchone()[0]))
            conn.rollback()
    return found


def test_rows_with_foreign_xids_are_relayed_in_id_order(outbox_db, broker, topic):
    future = [10**12 + 3, 10**12 + 2, 10**12 + 1]     # above anything assigned here
    aborted = sorted(aborted_xids(outbox_db, 3), reverse=True)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        with conn.transaction():  # restored before the relay starts: ids in order, xids not
            for seq, xid in enumerate(future):
                conn.execute("INSERT INTO outbox (topic, key, payload, xid) VALUES "
                             "(%s, 'restored', %s, %s::xid8)",
                             (topic, json.dumps({"seq": seq}), str(xid)))
    with RelayThread(outbox_db, broker.bootstrap, poll_interval_s=0.05):
        wait_drained(outbox_db, timeout_s=20)
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            with conn.transaction():  # replicated in while it runs
                for seq, xid in enumerate(aborted):
                    conn.execute("INSERT INTO outbox (topic, key, payload, xid) VALUES "
                                 "(%s, 'replicated', %s, %s::xid8)",
                                 (topic, json.dumps({"seq": seq}), str(xid)))
                    conn.execute("INSERT INTO outbox (topic, key, payload, xid) VALUES "
                                 "(%s, 'replicated-future', %s, %s::xid8)",
                                 (topic, json.dumps({"seq": seq}), str(future[seq] + 10)))
        wait_drained(outbox_db, timeout_s=60)  # the next full pass (every 10 s) finds them
    expected = all_event_ids(outbox_db)
    assert len(expected) == 9
    by_key: dict[str, list[int]] = {}
    seen: set[str] = set()
    for rec in read_all(broker.bootstrap, topic, expected=expected, timeout_s=30):
        event_id = rec.headers["event_id"].decode()
        if event_id not in seen:
            seen.add(event_id)
            by_key.setdefault(rec.key.decode(), []).append(json.loads(rec.value)["seq"])
    assert by_key == {"restored": [0, 1, 2], "replicated": [0, 1, 2],
                      "replicated-future": [0, 1, 2]}
