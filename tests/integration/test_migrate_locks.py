"""A migration that alters a live table waits for its lock at most --lock-timeout-s, then
tries again (3 tries) and gives up with the sessions to end.  While ALTER TABLE waits for
ACCESS EXCLUSIVE, every writer of the table queues behind it: without a bound, one
session idle in transaction during a deploy stalled every writer of the application for
as long as it stayed open.  Here: migration 0010 (it alters `outbox`) is made pending
again on a migrated database, and a writer stays in its transaction."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from typing import Any

import psycopg

from relay import migrate
from tests.fixtures.outbox import relay_cmd


def _pending_0010(dsn: str) -> None:
    migrate.apply(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM outbox_schema_migrations WHERE version = 10")


def _idle_writer(dsn: str) -> psycopg.Connection[Any]:
    conn = psycopg.connect(dsn)
    conn.execute("SET application_name = 'slow-writer'")
    conn.execute("INSERT INTO outbox (topic, payload) VALUES ('orders', '{}')")
    return conn  # in its transaction: ROW EXCLUSIVE on outbox until it ends


def test_a_blocked_migration_holds_writers_up_at_most_its_lock_timeout_then_names_the_blocker(db_dsn):
    _pending_0010(db_dsn)
    blocker = _idle_writer(db_dsn)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["applied"] = migrate.apply(db_dsn, lock_timeout_s=0.3, tries=3)
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            outcome["error"] = exc

    started = time.monotonic()
    migration = threading.Thread(target=run)
    migration.start()
    waits: list[float] = []
    with psycopg.connect(db_dsn, autocommit=True) as writer:
        writer.execute("SET statement_timeout = '10s'")
        while migration.is_alive() and time.monotonic() - started < 30:
            t0 = time.monotonic()
            writer.execute("INSERT INTO outbox (topic, payload) VALUES ('orders', '{}')")
            waits.append(time.monotonic() - t0)
    migration.join(30)
    blocker.close()
    assert not migration.is_alive()
    error = outcome.get("error")
    assert isinstance(error, migrate.MigrationBlocked), outcome
    message = str(error)
    assert "0010_cheaper_checks.sql" in message and "0.3 s, 3 times" in message
    assert "(slow-writer, idle in transaction" in message
    # The writers went on: each insert waited at most about one lock_timeout.
    assert len(waits) >= 3 and max(waits) < 1.5, waits
    # Once the long transaction is gone, the same command goes through.
    assert migrate.apply(db_dsn, lock_timeout_s=0.3, tries=3) == ["0010_cheaper_checks.sql"]


def test_migrate_blocked_exits_with_one_line_naming_the_session(db_dsn):
    _pending_0010(db_dsn)
    blocker = _idle_writer(db_dsn)
    try:
        done = subprocess.run(relay_cmd("migrate", "--lock-timeout-s", "0.2"), capture_output=True, text=True,
                              timeout=60, env={**os.environ, "OUTBOX_RELAY_DSN": db_dsn,
                                               "OUTBOX_RELAY_LOG_FORMAT": "json"})
    finally:
        blocker.close()
    assert done.returncode == 6
    assert "Traceback" not in done.stderr + done.stdout
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "could not take its table locks" in errors[0], done.stderr
    assert "slow-writer" in errors[0] and "--lock-timeout-s" in errors[0]


def test_the_lock_timeout_option_is_checked():
    done = subprocess.run(relay_cmd("migrate", "--lock-timeout-s", "soon"), capture_output=True, text=True,
                          timeout=60, env={**os.environ,
                                           "OUTBOX_RELAY_DSN": "postgresql://u@db.invalid/x"})
    assert done.returncode == 2 and "lock-timeout-s" in done.stderr and "Traceback" not in done.stderr


def test_a_migration_waits_for_a_short_transaction_to_end(db_dsn):
    """A writer whose transaction ends within the tries does not fail the migration."""
    _pending_0010(db_dsn)
    blocker = _idle_writer(db_dsn)
    threading.Timer(0.4, blocker.commit).start()  # after the first try's 0.2 s
    try:
        assert migrate.apply(db_dsn, lock_timeout_s=0.2, tries=3) == ["0010_cheaper_checks.sql"]
    finally:
        blocker.close()
