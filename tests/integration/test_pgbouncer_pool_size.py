"""A session pooler with fewer servers than the relay's connections (relay/connections.py).

Behind PgBouncer in session mode, a connection the pool has no server for waits at its
first query in the pooler's queue; the relay stalled there without a word (an operations
audit, a pool of 3).  Now it says which connection it cannot get and how many it needs,
keeps waiting, and runs once a server comes free.  Real PgBouncer in front of the test
PostgreSQL; without it the test skips with the reason (fails in CI, which installs it)."""

from __future__ import annotations

import json

import psycopg

from tests.fixtures.broker import read_all
from tests.fixtures.outbox import (
    all_event_ids,
    check_delivery,
    insert_rows,
    pending,
    relay_cmd,
    relay_env,
    wait_drained,
)
from tests.integration.test_pgbouncer import pgbouncer  # noqa: F401 - the fixture

#: The relay's connections by default: claims, LISTEN, marks, replays (relay/connections.py).
NEEDED = 4


def _event(log_text: str, name: str) -> dict[str, object]:
    for line in log_text.splitlines():
        if f'"{name}"' in line:
            event = json.loads(line)
            if event.get("event") == name:
                return dict(event)
    raise AssertionError(f"no {name} in the log")


def test_a_session_pool_short_of_a_server_is_named_and_waited_out(
        outbox_db, pgbouncer, broker, topic, spawn):  # noqa: F811 - the imported fixture
    pooled = pgbouncer("session", pool_size=NEEDED)
    insert_rows(outbox_db, topic, 300, keys=10)
    expected = all_event_ids(outbox_db)
    other = psycopg.connect(pooled, autocommit=True)  # another client holds one of the servers
    try:
        other.execute("SELECT 1")
        relay = spawn(relay_cmd("run"), env=relay_env(pooled, broker.bootstrap, owner="short-pool"),
                      name="relay")
        relay.wait_for_log("database_connection_waiting", timeout_s=60)
        waiting = _event(relay.log_text(), "database_connection_waiting")
        detail = str(waiting["detail"])
        assert waiting["level"] == "warning" and waiting["needed"] == NEEDED, waiting
        assert f"could not get connection {NEEDED} of {NEEDED} (outbox-relay:short-pool:replay" in detail, detail
        assert "a pooler with fewer server connections than the relay needs?" in detail, detail
        assert f"the relay needs {NEEDED} connections: claims and leases (outbox-relay:short-pool)" in detail
        assert pending(outbox_db) == 300 and relay.alive
    finally:
        other.close()  # its server goes back to the pool: the relay's connection gets it

    relay.wait_for_log("database_connection_ready", timeout_s=60)
    wait_drained(outbox_db, timeout_s=60)
    relay.sigterm()
    assert relay.wait(30) == 0
    assert "Traceback" not in relay.log_text()
    delivery = check_delivery(read_all(broker.bootstrap, topic, expected=expected, timeout_s=60), expected)
    assert delivery.missing == set() and delivery.order_violations == []
