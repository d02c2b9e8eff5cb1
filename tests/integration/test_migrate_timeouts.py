"""`migrate` under a role's statement_timeout, and a migration the server cancels.

A DBA's `ALTER ROLE ... SET statement_timeout = '50ms'` is meant for the application's
queries.  Before, it cancelled any migration that took longer (a lock wait, a constraint
validated on a large outbox), rolled back, the same at every try, and migrate said only
"statement cancelled: canceling statement due to statement timeout", exit 1: not which
migration, nor what to do.  Now migrate lifts it in its own transactions (its waits are
bounded by its own --lock-timeout-s), and a migration cancelled all the same (an
operator's pg_cancel_backend) is one line naming it, exit 6."""

from __future__ import annotations

import os
import subprocess
import threading
from typing import Any

import psycopg
from psycopg import sql

from relay import migrate
from tests.fixtures.outbox import relay_cmd
from tests.fixtures.procs import wait_until

WAITING_MIGRATE = """
SELECT pid FROM pg_stat_activity
WHERE datname = current_database() AND application_name = 'outbox-relay-migrate'
  AND wait_event_type = 'Lock' AND wait_event = 'relation'
  AND now() - query_start > make_interval(secs => %(waited_s)s)
"""


def _pending_0010_behind_a_writer(dsn: str) -> psycopg.Connection[Any]:
    """0010 (it alters `outbox`) pending again, and a writer in its transaction: the
    migration waits for its table lock until the test ends that transaction."""
    migrate.apply(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM outbox_schema_migrations WHERE version = 10")
    writer = psycopg.connect(dsn)
    writer.execute("INSERT INTO outbox (topic, payload) VALUES ('orders', '{}')")
    return writer


def _role_statement_timeout(dsn: str, value: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER ROLE current_user IN DATABASE {} SET statement_timeout = {}").format(
            sql.Identifier(conn.info.dbname), sql.Literal(value)))


def _migrate_waiting(dsn: str, waited_s: float) -> int | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(WAITING_MIGRATE, {"waited_s": waited_s}).fetchone()
    return int(row[0]) if row else None


def test_a_role_statement_timeout_does_not_cancel_a_migration(db_dsn):
    writer = _pending_0010_behind_a_writer(db_dsn)
    _role_statement_timeout(db_dsn, "50ms")
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["applied"] = migrate.apply(db_dsn, lock_timeout_s=30)
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        # Waits for its lock well past the role's 50 ms (before: cancelled at 50 ms).
        wait_until(lambda: not thread.is_alive() or _migrate_waiting(db_dsn, 0.3), 30,
                   message="migrate neither waited nor ended")
    finally:
        writer.commit()
        writer.close()
    thread.join(60)
    assert outcome == {"applied": ["0010_cheaper_checks.sql"]}
    # Nothing of migrate's is left on the role's sessions: a new one has the role's setting.
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        assert conn.execute("SHOW statement_timeout").fetchone() == ("50ms",)


def test_a_cancelled_migration_is_one_line_naming_it(db_dsn):
    writer = _pending_0010_behind_a_writer(db_dsn)
    proc = subprocess.Popen(relay_cmd("migrate", "--lock-timeout-s", "30"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OUTBOX_RELAY_DSN": db_dsn, "OUTBOX_RELAY_LOG_FORMAT": "json"})
    try:
        pid = wait_until(lambda: _migrate_waiting(db_dsn, 0.0), 30, message="migrate never waited for its lock")
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_cancel_backend(%s)", (pid,))
        out, err = proc.communicate(timeout=60)
    finally:
        writer.rollback()
        writer.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 6, (out, err)
    assert "Traceback" not in out + err
    [line] = err.strip().splitlines()
    assert "migration 0010_cheaper_checks.sql (level 10) was cancelled" in line
    assert "canceling statement due to user request" in line and "run migrate again" in line


def test_a_migrate_waiting_for_another_outlasts_a_role_lock_timeout(db_dsn):
    """The second of two migrates waits for the first's run lock: a role's lock_timeout
    ended that wait (lock_not_available, a traceback) while the first ran longer."""
    from tests.integration.test_migrate_races import ALL, _first_paused, _waiting_for_the_run_lock

    first, log = _first_paused(db_dsn, partitioned=False)  # its sessions began before the setting
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER ROLE current_user IN DATABASE {} SET lock_timeout = '100ms'").format(
            sql.Identifier(conn.info.dbname)))
    second = subprocess.Popen(relay_cmd("migrate"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OUTBOX_RELAY_DSN": db_dsn, "OUTBOX_RELAY_LOG_FORMAT": "json"})
    try:  # waiting past the role's 100 ms
        wait_until(lambda: second.poll() is not None or _waiting_for_the_run_lock(db_dsn, 0.3), 30,
                   message="the second migrate neither waited nor ended")
    finally:
        log.go_on.set()
    out, err = second.communicate(timeout=60)
    first.join(60)
    assert first.error is None and first.applied == ALL
    assert "Traceback" not in out + err
    assert second.returncode == 0, (out, err)
    assert "migrations applied: none" in out


def test_migrate_prints_a_script_a_role_statement_timeout_does_not_cancel(db_dsn):
    # `migrate --print` is for teams that run their own migration tool.  Its script set the
    # lock_timeout but kept the role's statement_timeout: a statement waiting for its table
    # lock behind a writer was cancelled at the role's 50 ms, where `migrate` now waits.
    migrate.apply(db_dsn)  # the script runs again over an outbox that exists: every file is idempotent
    writer = psycopg.connect(db_dsn)
    writer.execute("INSERT INTO outbox (topic, payload) VALUES ('orders', '{}')")
    _role_statement_timeout(db_dsn, "50ms")
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            with psycopg.connect(db_dsn, autocommit=True, application_name="print-script") as conn:
                conn.execute(migrate.render(lock_timeout_s=30).encode())
            outcome["done"] = True
        except psycopg.Error as exc:
            outcome["error"] = str(exc).splitlines()[0]

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: not thread.is_alive() or _script_waiting(db_dsn, 0.3), 30,
                   message="the script neither waited nor ended")
    finally:
        writer.commit()
        writer.close()
    thread.join(60)
    assert outcome == {"done": True}


def _script_waiting(dsn: str, waited_s: float) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'print-script' "
                           "AND wait_event_type = 'Lock' AND now() - query_start > make_interval(secs => %s)",
                           (waited_s,)).fetchone()
    return bool(row and row[0])
