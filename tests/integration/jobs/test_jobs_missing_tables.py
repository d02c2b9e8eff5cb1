"""A table missing under a worker pool's statements, on a real PostgreSQL: a trigger's table
dropped (an audit trigger on ``jobs``), the jobs tables themselves missing (not migrated yet
when the pool starts, renamed or dropped while it runs).

Either went the old way, unlike every other refusal of the pool's own statements: a
``dispatch_failed`` warning at every round, tried again after at most ``poll_interval_s``,
no metric, and ``pool.health()`` ready all along; the message said "the jobs schema is
missing: run migrate" even for the audit trigger's table, which no migration brings back.
Now both are refusals (:mod:`consumer_sdk.jobs.refusals`): back-off, counted, logged once
per cause with the database's words and what to do, not ready while it lasts, and nothing
is lost: once the table is back every job runs, its first attempt.
"""

from __future__ import annotations

from typing import Any

import pytest

from consumer_sdk.errors import SchemaMissing
from consumer_sdk.jobs import NewJob, TableMissing, enqueue
from consumer_sdk.jobs import queue as jobq
from tests.fixtures.procs import wait_until
from tests.integration.jobs._refused_claims import (
    claims_tried,
    job_rows,
    on_every_claim,
    pool_of,
    refuse_claims_while_a_job_runs,
    sample,
)
from tests.integration.jobs._support import claim_next


def _log_claims(conn: Any) -> None:
    """Record every claim in t_claim_log: a table an operator may drop, thinking it unused."""
    conn.execute("CREATE TABLE t_claim_log (job_id bigint NOT NULL)")
    on_every_claim(conn, "t_log_claim", "INSERT INTO t_claim_log (job_id) VALUES (NEW.id);\n    RETURN NEW;")


def _events(logged: list[dict[str, Any]], *names: str) -> list[dict[str, Any]]:
    return [e for e in logged if e["event"] in names]


def test_a_trigger_whose_table_was_dropped_refuses_the_claim_with_back_off_and_loses_nothing(conn, jobs_db) -> None:
    _log_claims(conn)
    seen = refuse_claims_while_a_job_runs(
        conn, jobs_db, refuse=lambda: conn.execute("DROP TABLE t_claim_log"),
        let_through=lambda: conn.execute("CREATE TABLE t_claim_log (job_id bigint NOT NULL)"),
        refusals=lambda: claims_tried(jobs_db, "t_log_claim") - 1)  # the first claim passed
    assert 'relation "t_claim_log" does not exist' in seen.reason, seen
    assert "t_log_claim()" in seen.reason and "migrate" not in seen.reason, seen
    assert seen.refused["sqlstate"] == "42P01", seen
    assert "create it again or fix the function" in seen.refused["hint"], seen


def test_the_jobs_tables_missing_at_the_start_or_while_the_pool_runs_are_refusals_until_they_are_back(
        conn, jobs_db) -> None:
    logged: list[dict[str, Any]] = []
    conn.execute("ALTER TABLE jobs RENAME TO t_jobs_away")  # not migrated yet, as far as the pool can see
    pool = pool_of(jobs_db, {"ok": lambda ctx: "fine"}, logged)
    pool.start()
    try:
        health = wait_until(lambda: (h := pool.health()).refusals.get("claim", 0) >= 2 and h, timeout_s=20,
                            message=lambda: f"the pool's health says so: {pool.health()}")
        assert not health.ready and pool.error is None, health
        assert 'the jobs schema is missing (relation "jobs" does not exist)' in health.reasons[0], health
        assert "run `outbox-relay migrate`" in health.reasons[0], health
        assert sample(pool, "outbox_jobs_dispatch_refused", "claim") == 1.0
        conn.execute("ALTER TABLE t_jobs_away RENAME TO jobs")
        # Ready again with nothing to claim: the check of the jobs tables passed.
        wait_until(lambda: pool.health().ready, timeout_s=20, message=lambda: str(pool.health()))
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={}) for _ in range(2)])
        wait_until(lambda: job_rows(jobs_db) == [("ok", "succeeded", 1)] * 2, timeout_s=20,
                   message=lambda: f"claimed: {job_rows(jobs_db)}")
        # Gone while the pool runs (its lanes, its claims, its reaps meet it): the same.
        conn.execute("ALTER TABLE jobs RENAME TO t_jobs_away")
        wait_until(lambda: not pool.health().ready, timeout_s=20, message=lambda: str(pool.health()))
        assert "the jobs schema is missing" in pool.health().reasons[0], pool.health()
        conn.execute("ALTER TABLE t_jobs_away RENAME TO jobs")
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={})])
        wait_until(lambda: job_rows(jobs_db) == [("ok", "succeeded", 1)] * 3, timeout_s=40,
                   message=lambda: f"claimed once the table is back: {job_rows(jobs_db)}")
        wait_until(lambda: pool.health().ready, timeout_s=40, message=lambda: str(pool.health()))
    finally:
        pool.stop()
    assert not _events(logged, "dispatch_failed", "dispatch_crashed")
    refused = [e for e in _events(logged, "dispatch_refused") if e["statement"] == "claim"]
    assert len(refused) == 2, refused  # once at the start, once when the table went away
    assert {e["sqlstate"] for e in refused} == {"42P01"}, refused
    assert all("run `outbox-relay migrate`" in e["hint"] for e in refused), refused
    assert dict(pool.outcomes) == {"succeeded": 3}


def test_a_missing_table_is_the_jobs_schema_or_a_functions_by_where_the_database_met_it(conn, jobs_db) -> None:
    _log_claims(conn)
    conn.execute("DROP TABLE t_claim_log")
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={})])
    with pytest.raises(TableMissing) as trigger:  # a SchemaMissing still, for those who catch that
        claim_next(conn, "w", now=None, queues=("bulk",))
    assert isinstance(trigger.value, SchemaMissing) and trigger.value.exit_code == 3
    assert str(trigger.value).startswith(
        'relation "t_claim_log" does not exist, in PL/pgSQL function t_log_claim() line 4 at SQL statement')
    conn.execute("ALTER TABLE job_activations RENAME TO t_activations_away")
    with pytest.raises(SchemaMissing) as schema:
        jobq.check_schema(conn)
    assert not isinstance(schema.value, TableMissing)
    assert str(schema.value) == ('the jobs schema is missing (relation "job_activations" does not exist): '
                                 "run `outbox-relay migrate` (0005_jobs)")


def test_a_schema_older_than_the_sdk_is_said_at_the_pools_start_until_migrated(conn, jobs_db) -> None:
    # Migration 0018's columns missing (a pool upgraded before `migrate` ran): the pool started,
    # ready, and met the missing column only at a job's first conflict, whose give-back then
    # failed as 'jobs statement failed: column ... does not exist'.  Now its schema check names
    # the newest columns: a refusal that says to migrate, until they are there.
    logged: list[dict[str, Any]] = []
    conn.execute("ALTER TABLE jobs RENAME COLUMN conflict_interruptions TO t_away")
    with pytest.raises(SchemaMissing) as behind:
        jobq.check_schema(conn)
    assert str(behind.value) == ('the jobs schema is older than this SDK (column j.conflict_interruptions does '
                                 'not exist): run `outbox-relay migrate`'), behind.value
    pool = pool_of(jobs_db, {"ok": lambda ctx: "fine"}, logged)
    pool.start()
    try:
        health = wait_until(lambda: (h := pool.health()).refusals.get("claim", 0) >= 1 and h, timeout_s=20,
                            message=lambda: f"the pool's health says so: {pool.health()}")
        assert not health.ready and "older than this SDK" in health.reasons[0], health
        conn.execute("ALTER TABLE jobs RENAME COLUMN t_away TO conflict_interruptions")
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={})])
        wait_until(lambda: job_rows(jobs_db) == [("ok", "succeeded", 1)], timeout_s=20,
                   message=lambda: f"claimed once migrated: {job_rows(jobs_db)}")
    finally:
        pool.stop()
