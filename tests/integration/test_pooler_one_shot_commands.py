"""The one-shot commands through a transaction pooler leave the application's sessions as they were.

README: `migrate`, `status`, `cleanup` (and `replay`, `dead-letters list`) keep no session
state and work through a transaction pooler, where the server connection a command used is
the one the application's next transaction gets.  Before: `cleanup`, `replay` and `status`
(its replays section) opened their connection the way the relay daemon does, with
`synchronous_commit = off` and `idle_session_timeout = 0` set for the session.  Through a
transaction pooler that setting stayed on the server connection: the application's own
transactions there committed without waiting for the WAL flush, so a database crash could
lose transactions (outbox rows with them) it had been told were committed.  And psycopg
prepared a statement executed five times on one server connection: `cleanup`'s sixth batch
went to another and failed, "prepared statement "_pg3_0" does not exist", a traceback."""

from __future__ import annotations

import os
import subprocess

import psycopg
import pytest
from psycopg import sql

from relay import migrate
from tests.fixtures.outbox import relay_cmd
from tests.integration.test_pgbouncer import pgbouncer  # noqa: F401 - the fixture

SETTINGS = "SELECT current_setting('synchronous_commit'), current_setting('idle_session_timeout')"
OLD_ROWS = 2_000  # published a day ago: 20 batches of cleanup's 100


def _sessions_through(pooled: str, count: int = 3) -> set[tuple[str, str]]:
    """The two settings as ``count`` sessions at once see them through the pooler (each its
    own server connection: every server connection the pool holds)."""
    conns = [psycopg.connect(pooled) for _ in range(count)]
    try:
        return {conn.execute(SETTINGS).fetchone() for conn in conns}  # type: ignore[misc]
    finally:
        for conn in conns:
            conn.close()


def _run(pooled: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(relay_cmd(*args), capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env={**os.environ, "OUTBOX_RELAY_DSN": pooled, "OUTBOX_RELAY_LOG_FORMAT": "json"})


@pytest.mark.parametrize("args", [
    ("cleanup", "--cleanup-retention-s", "60", "--cleanup-batch", "100"),
    ("status",),
    ("replay", "list"),
])
def test_a_one_shot_command_through_a_transaction_pooler_keeps_no_session_state(db_dsn, pgbouncer, args):  # noqa: F811
    migrate.apply(db_dsn)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        for setting, value in (("synchronous_commit", "on"), ("idle_session_timeout", "10min")):  # the test
            conn.execute(sql.SQL("ALTER DATABASE {} SET {} = {}").format(  # server runs with it off
                sql.Identifier(conn.info.dbname), sql.Identifier(setting), sql.Literal(value)))
        conn.execute("INSERT INTO outbox (topic, key, payload, published_at) "
                     "SELECT 'orders', 'k' || g, '{}', now() - interval '1 day' FROM generate_series(1, %s) AS g",
                     (OLD_ROWS,))
    pooled = pgbouncer("transaction", 3, round_robin=True)  # each transaction: the server idle longest
    before = _sessions_through(pooled)
    assert before == {("on", "10min")}, before
    done = _run(pooled, *args)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert _sessions_through(pooled) == before
    if args[0] == "cleanup":
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
