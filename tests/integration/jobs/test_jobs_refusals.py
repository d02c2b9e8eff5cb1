"""Writes the database refuses, on a real PostgreSQL: for good, for a moment, or for want of a grant.

A round's completions go in one statement with its claim.  When the database refused it
for a reason other than a size limit (a CHECK, a trigger, a value it cannot read), the
round was put back and sent again at every round, for ever: its jobs stayed running and
nothing was claimed again (IntegrityError), or the pool stopped claiming altogether
(DataError and RaiseException read as FatalError).  The executor's own writes (with an
events topic) read the latter as "database unavailable" and left the job to its lease,
attempt after attempt (an audit of the pool).  Now a refusal that would refuse again
fails that job for good, with the database's words in its dead letter, and the pool
runs on; a passing error is retried; a missing grant stops the pool with a clear error.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from consumer_sdk.jobs import Backoff, NewJob, PrivilegeMissing, WorkerConfig, WorkerPool, enqueue
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import recording_logger, rows

FAST = {"backoff": Backoff(initial_s=0.05, max_s=0.1), "poll_interval_s": 0.1, "reconcile_interval_s": 0.5}
EVENTS = "jobs.events"

#: Each refuses the completion of the jobs of kind 'refused' only, as PostgreSQL itself would.
REFUSALS = {
    # a CHECK constraint of the service's own (23514)
    "check": ("ALTER TABLE jobs ADD CONSTRAINT t_refused_never_succeeds "
              "CHECK (status <> 'succeeded' OR kind <> 'refused') NOT VALID",
              'violates check constraint "t_refused_never_succeeds"'),
    # a value the database cannot read (22P02, a DataError: read as FatalError, it stopped the pool)
    "data": ("""CREATE FUNCTION t_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN PERFORM ('n/a: ' || NEW.id)::int; RETURN NEW; END $$;
                CREATE TRIGGER t_refuse BEFORE UPDATE ON jobs FOR EACH ROW
                    WHEN (NEW.status = 'succeeded' AND NEW.kind = 'refused') EXECUTE FUNCTION t_refuse()""",
             "invalid input syntax for type integer"),
    # a trigger's RAISE (P0001)
    "trigger": ("""CREATE FUNCTION t_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
                   BEGIN RAISE EXCEPTION 'job % may not succeed: refused by policy', NEW.id; END $$;
                   CREATE TRIGGER t_refuse BEFORE UPDATE ON jobs FOR EACH ROW
                       WHEN (NEW.status = 'succeeded' AND NEW.kind = 'refused') EXECUTE FUNCTION t_refuse()""",
                "may not succeed: refused by policy"),
}


def _dead_letters(dsn: str) -> dict[str, tuple[Any, ...]]:
    found = rows(dsn, "SELECT j.kind, d.reason, d.error_type, d.error, d.attempts, j.status FROM job_dead_letters d "
                      "JOIN jobs j ON j.id = d.job_id")
    return {r[0]: r[1:] for r in found}


def _succeeded(dsn: str) -> int:
    return int(rows(dsn, "SELECT count(*) FROM jobs WHERE kind = 'ok' AND status = 'succeeded'")[0][0])


@pytest.mark.parametrize("events", [False, True], ids=["round", "executor"])
@pytest.mark.parametrize("refusal", sorted(REFUSALS))
def test_a_completion_the_database_refuses_fails_its_job_and_the_pool_runs_on(conn, jobs_db, pools, refusal: str,
                                                                               events: bool) -> None:
    # Without an events topic the successes go in the round's statement (with the others'
    # and the claim); with one, each is written by its executor with its event.
    ddl, words = REFUSALS[refusal]
    conn.execute(ddl)
    pool = pools({"refused": lambda ctx: {"n": 1}, "ok": lambda ctx: "fine"}, max_concurrency=2,
                 lease_duration_s=30.0, events_topic=EVENTS if events else None, **FAST)
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={}) for _ in range(5)]
            + [NewJob(owner_id="o", queue="bulk", kind="refused", payload={}, max_attempts=5)]
            + [NewJob(owner_id="o", queue="bulk", kind="ok", payload={}) for _ in range(5)])
    wait_until(lambda: "refused" in _dead_letters(jobs_db) and _succeeded(jobs_db) == 10, timeout_s=20,
               message=lambda: str(rows(jobs_db, "SELECT kind, status, attempts FROM jobs ORDER BY id")))
    reason, error_type, error, attempts, status = _dead_letters(jobs_db)["refused"]
    assert (reason, error_type, attempts, status) == ("permanent_error", "InvalidJob", 1, "failed")
    assert "the database refused the row" in error and words in error, error
    assert pool.error is None and pool.outcomes["failed"] == 1
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={}) for _ in range(3)])
    wait_until(lambda: _succeeded(jobs_db) == 13, timeout_s=20, message="the pool claims on")
    if events:
        assert rows(jobs_db, "SELECT payload->>'type', count(*) FROM outbox GROUP BY 1 ORDER BY 1") == \
            [("job.failed", 1), ("job.succeeded", 13)]


@pytest.mark.parametrize("sqlstate", ["40001", "40P01", "55P03", "57014", "57P01"],
                         ids=["serialization", "deadlock", "lock_timeout", "cancelled", "admin_shutdown"])
def test_a_passing_refusal_of_a_round_is_tried_again_and_the_job_succeeds(conn, jobs_db, pools, sqlstate: str) -> None:
    # The first two rounds that complete the job meet the error (a sequence counts: it is
    # not rolled back with them); the third writes it.  No attempt is counted, no dead letter.
    conn.execute(sql.SQL("""
        CREATE SEQUENCE t_refusals;
        CREATE FUNCTION t_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF nextval('t_refusals') <= 2 THEN
                RAISE EXCEPTION 'passing trouble' USING ERRCODE = {};
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER t_refuse BEFORE UPDATE ON jobs FOR EACH ROW
            WHEN (NEW.status = 'succeeded') EXECUTE FUNCTION t_refuse()""").format(sql.Literal(sqlstate)))
    pool = pools({"ok": lambda ctx: "fine"}, max_concurrency=1, lease_duration_s=30.0, **FAST)
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={})])
    wait_until(lambda: _succeeded(jobs_db) == 1, timeout_s=20,
               message=lambda: str(rows(jobs_db, "SELECT status, attempts, last_error FROM jobs")))
    assert rows(jobs_db, "SELECT attempts FROM jobs") == [(1,)]
    assert rows(jobs_db, "SELECT last_value FROM t_refusals") == [(3,)]
    assert _dead_letters(jobs_db) == {} and pool.error is None and dict(pool.outcomes) == {"succeeded": 1}


@contextlib.contextmanager
def _role_lacking(jobs_db: str, table: str) -> Iterator[str]:
    """The DSN of a login role with every privilege the jobs need but INSERT and UPDATE on
    ``table`` (a least-privilege role missing a grant)."""
    role, password = f"t_jobs_{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    with psycopg.connect(jobs_db, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(role), sql.Literal(password)))
        for grant in ("GRANT USAGE ON SCHEMA public TO {}",
                      "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {}",
                      "GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {}",
                      "GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA public TO {}",
                      "REVOKE INSERT, UPDATE ON {} FROM {}"):
            admin.execute(sql.SQL(grant).format(*([sql.Identifier(table)] if grant.startswith("REVOKE") else []),
                                                sql.Identifier(role)))
    try:
        yield make_conninfo(jobs_db, user=role, password=password)
    finally:
        with psycopg.connect(jobs_db, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.mark.parametrize(("table", "jobs_after"), [
    # The reaper writes dead letters (its statement needs the grant even when nothing expired):
    # the first round fails, nothing is claimed.
    ("job_dead_letters", [("ok", "queued", 0)] * 4),
    # A success with an events topic is written by its executor with its event: the first
    # job's completion fails, and no other job is claimed (its attempt counted, its outcome
    # unwritten: read as "database unavailable", the pool claimed and lost them one by one).
    ("outbox", [("ok", "running", 1)] + [("ok", "queued", 0)] * 3),
])
def test_a_missing_grant_stops_the_pool_with_an_error_that_says_what_to_grant(
        conn, jobs_db, pools, table: str, jobs_after: list[tuple[Any, ...]]) -> None:
    # A deployment error, the same for every job: the pool stops claiming at once and says
    # which grant is missing (pool.error, the pool_failed line), the queue left as it is.
    logged: list[dict[str, Any]] = []
    with _role_lacking(jobs_db, table) as dsn:
        pool = WorkerPool(WorkerConfig(dsn=dsn, max_concurrency=1, lease_duration_s=30.0, events_topic=EVENTS,
                                       **FAST), {"ok": lambda ctx: "fine"},
                          log=recording_logger(logged))
        pool.start()
        try:
            enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={}) for _ in range(4)])
            wait_until(lambda: pool.error is not None, timeout_s=20, message="the pool failed")
            assert isinstance(pool.error, PrivilegeMissing)
            assert f"permission denied for table {table}" in str(pool.error)
            assert "grant it to this connection's role" in str(pool.error)
            failed = [e for e in logged if e["event"] == "pool_failed"]
            assert [(e["error_type"], e["error"]) for e in failed] == [("PrivilegeMissing", str(pool.error))]
            wait_until(lambda: not pool.busy_by_queue(), timeout_s=10, message="the running job ended")
            assert rows(jobs_db, "SELECT kind, status, attempts FROM jobs ORDER BY id") == jobs_after
        finally:
            pool.stop(drain_timeout_s=0.5)
