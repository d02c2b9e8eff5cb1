"""A connection the relay re-opens at run time behind a session pooler with no server free.

At start, each of the relay's connections is opened within a bound, and one the pool has
no server for is named (`database_connection_waiting`, relay/connections.py).  After the
database went away (a restart, a failover; here its server sessions ended), the loop
re-opened its connections without that check: one queued in the pooler held the loop at
its first statement, without a word, until liveness failed.  Now the loop's connections
are checked again as they are re-opened, with the start's message.  Real PgBouncer in
front of the test PostgreSQL; without it the test skips (fails in CI, which installs it)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from tests.fixtures.outbox import insert_rows, pending, relay_cmd, relay_env, wait_drained
from tests.integration.test_pgbouncer import pgbouncer  # noqa: F401 - the fixture

#: The relay's connections with one mark connection: claims, LISTEN, marks, replays.
NEEDED = 4


@contextmanager
def _every_server_taken(pooled: str) -> Iterator[list[threading.Thread]]:
    """NEEDED other clients, each queued for a server of the pool and holding it once it has
    one, until the block ends."""
    release = threading.Event()

    def hold() -> None:
        with psycopg.connect(pooled, autocommit=True) as conn:
            conn.execute("SELECT 1")
            release.wait(120)

    threads = [threading.Thread(target=hold, daemon=True) for _ in range(NEEDED)]
    for thread in threads:
        thread.start()
    try:
        yield threads
    finally:
        release.set()
        for thread in threads:
            thread.join(30)


def _events(log_text: str, name: str) -> list[dict[str, object]]:
    found = []
    for line in log_text.splitlines():
        if f'"{name}"' in line:
            event = json.loads(line)
            if event.get("event") == name:
                found.append(dict(event))
    return found


def _end_relay_sessions(dsn: str, owner: str) -> int:
    """End the relay's server sessions (as a database restart does), directly on PostgreSQL."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return len(conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
            "AND (application_name LIKE %s OR application_name = 'outbox-relay-listen')",
            (f"outbox-relay:{owner}%",)).fetchall())


def test_a_connection_reopened_with_no_server_free_is_named_as_at_start(
        outbox_db, pgbouncer, broker, topic, spawn):  # noqa: F811 - the imported fixture
    pooled = pgbouncer("session", pool_size=NEEDED)
    relay = spawn(relay_cmd("run"), env=relay_env(pooled, broker.bootstrap, owner="reopen", mark_connections=1),
                  name="relay")
    relay.wait_for_log("relay_started", timeout_s=60)
    insert_rows(outbox_db, topic, 20, keys=4)
    wait_drained(outbox_db, timeout_s=60)
    since = relay.log_size()
    with _every_server_taken(pooled):
        assert _end_relay_sessions(outbox_db, "reopen") == NEEDED
        insert_rows(outbox_db, topic, 20, keys=4, start=20)
        # Which of the loop's connections re-opens first (the claims' after a failed statement,
        # or LISTEN's, which re-opens itself) is a race: either is named.
        relay.wait_for_log("database_connection_waiting", timeout_s=40, since=since)
        waiting = _events(relay.log_text(), "database_connection_waiting")[-1]
        assert waiting["level"] == "warning" and waiting["needed"] == NEEDED, waiting
        assert waiting["reopened"] is True and waiting["connection"] in {
            "outbox-relay:reopen", "outbox-relay-listen", "outbox-relay:reopen:replay"}, waiting
        detail = str(waiting["detail"])
        assert "a pooler with fewer server connections than the relay needs?" in detail, detail
        assert f"the relay needs {NEEDED} connections: claims and leases (outbox-relay:reopen)" in detail, detail
        assert pending(outbox_db) == 20 and relay.alive
    relay.wait_for_log("database_connection_ready", timeout_s=60, since=since)
    wait_drained(outbox_db, timeout_s=60)
    relay.sigterm()
    assert relay.wait(30) == 0
    assert "Traceback" not in relay.log_text()
