"""Timeouts a DBA sets on the relay's role or database.

``idle_session_timeout``: the relay's sessions idle between polls by design.  Ended by the
server, they flapped (database_unavailable, database_recovered), and a mark lost with one
sent its rows again: 8 duplicates of 9 rows at a row every 5 s with a 3 s timeout (an
audit of the relay's operation).  The relay turns it off for its own sessions.
"""

from __future__ import annotations

import time

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from tests.fixtures.broker import create_topic, read_all
from tests.fixtures.outbox import (
    RelayThread,
    all_event_ids,
    check_delivery,
    insert_rows,
    wait_drained,
)


def test_an_idle_session_timeout_ends_none_of_the_relays_sessions(outbox_db, broker, topic):
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER DATABASE {} SET idle_session_timeout = '1s'").format(
            sql.Identifier(conninfo_to_dict(outbox_db)["dbname"])))
    create_topic(broker.bootstrap, topic, partitions=1)
    with RelayThread(outbox_db, broker.bootstrap, poll_interval_s=1.0):
        insert_rows(outbox_db, topic, 1, keys=1)
        wait_drained(outbox_db, timeout_s=30)
        opened = _relay_sessions(outbox_db)
        for i in range(1, 4):  # a row now and then, the relay idle in between
            time.sleep(2.5)  # noqa: TID251 - idle longer than the server's timeout
            insert_rows(outbox_db, topic, 1, keys=1, start=i)
            wait_drained(outbox_db, timeout_s=30)
        kept = _relay_sessions(outbox_db)
    # The sessions the relay opened are the ones it still has: none was ended and replaced.
    assert opened and opened <= kept, (opened, kept)
    expected = all_event_ids(outbox_db)
    delivery = check_delivery(read_all(broker.bootstrap, topic, expected=expected, timeout_s=30,
                                       extra_wait_s=1), expected)
    assert delivery.missing == set() and delivery.duplicates == 0, delivery


def _relay_sessions(dsn: str) -> set[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                            "AND application_name LIKE 'outbox-relay%%'").fetchall()
    return {int(r[0]) for r in rows}
