"""Helpers of the jobs integration and fault tests: a migrated database with effect and audit
tables, controlled time, and a claim step that does what a worker's dispatcher does.

`effects` has no unique constraint: a write that commits twice shows as two rows.
`job_audit` records every status change of `jobs` (a trigger), so "completed once"
is a count, not a guess.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Sequence
from typing import Any

import psycopg
import structlog
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from consumer_sdk.jobs import queue as jobq
from consumer_sdk.jobs.fairness import Limits, plan
from consumer_sdk.jobs.model import ClaimedJob
from relay import migrate

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)

TEST_DDL = """
CREATE TABLE effects (
    job_id  bigint NOT NULL,
    token   bigint NOT NULL,
    step    int    NOT NULL,
    worker  text,
    at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE job_audit (
    job_id  bigint NOT NULL,
    status  text NOT NULL,
    token   bigint NOT NULL,
    owner   text,
    at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION job_audit_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO job_audit (job_id, status, token, owner)
    VALUES (NEW.id, NEW.status, NEW.lease_token, NEW.lease_owner);
    RETURN NULL;
END $$;
CREATE TRIGGER job_audit_status AFTER UPDATE OF status ON jobs
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status) EXECUTE FUNCTION job_audit_row();
"""


def migrate_jobs_db(dsn: str) -> str:
    """The project's schema (outbox, inbox, runs, jobs...) plus the test tables."""
    migrate.apply(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(TEST_DDL)
    return dsn


def at(seconds: float) -> dt.datetime:
    """Controlled time: T0 + seconds."""
    return T0 + dt.timedelta(seconds=seconds)


def claim_next(conn: psycopg.Connection[Any], worker: str, *, now: dt.datetime | None,
               queues: Sequence[str] = ("interactive", "bulk"), lease_s: float = 10.0,
               max_concurrency: int = 1, owner_limit: int = 1_000_000) -> list[ClaimedJob]:
    """What one dispatcher round does: reap expired leases, list lanes, plan, claim."""
    jobq.reap_expired(conn, now=now)
    lanes = jobq.ready_lanes(conn, queues=queues, now=now)
    takes = plan(lanes, queues=queues, busy={},
                 limits=Limits(max_concurrency=max_concurrency, owner_limit=owner_limit),
                 last_served={})
    return jobq.claim(conn, worker=worker, takes=takes, lease_s=lease_s, now=now)


def rows(dsn: str, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


def scalar(dsn: str, sql: str, params: Any = None) -> Any:
    found = rows(dsn, sql, params)
    return found[0][0] if found else None


def job_status(dsn: str, job_id: int) -> str:
    return str(scalar(dsn, "SELECT status FROM jobs WHERE id = %s", (job_id,)))


def recording_logger(into: list[dict[str, Any]]) -> Any:
    """A pool's ``log=``: each event's fields (bound ones too) and its monotonic time (``at``)
    appended to ``into``, nothing printed."""
    def record(_logger: Any, _level: str, event: dict[str, Any]) -> dict[str, Any]:
        into.append({**event, "at": time.monotonic()})
        raise structlog.DropEvent

    return structlog.wrap_logger(None, processors=[record])


#: A session's options that keep it writable while the database's new sessions are read-only.
WRITABLE = "-c default_transaction_read_only=off"


def set_read_only(dsn: str, on: bool, *, end_sessions: bool) -> None:
    """The database's new sessions read-only (or not), as a standby's or a failover's are; with
    ``end_sessions``, its sessions ended (the pool's connections must open new ones)."""
    dbname = conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(dsn, autocommit=True, options=WRITABLE) as conn:
        setting = "SET default_transaction_read_only = on" if on else "RESET default_transaction_read_only"
        conn.execute(sql.SQL("ALTER DATABASE {} " + setting).format(sql.Identifier(dbname)))
        if end_sessions:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE datname = %s AND pid <> pg_backend_pid()", (dbname,))
