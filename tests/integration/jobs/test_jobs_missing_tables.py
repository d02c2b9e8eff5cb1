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

import threading
import time
from typing import Any

import pytest

from consumer_sdk.errors import SchemaMissing
from consumer_sdk.jobs import NewJob, TableMissing, enqueue
from consumer_sdk.jobs import queue as jobq
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import claim_next, rows
from tests.integration.jobs.test_jobs_claim_refusals import _jobs, _pool, _sample

#: Records every claim (a queued job becoming running) in t_claim_log: a table an operator
#: may drop, thinking it unused.  Each try is counted in a sequence (not rolled back).
CLAIM_LOG = """
CREATE SEQUENCE t_claims_tried;
CREATE TABLE t_claim_log (job_id bigint NOT NULL);
CREATE FUNCTION t_log_claim() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval('t_claims_tried');
    INSERT INTO t_claim_log (job_id) VALUES (NEW.id);
    RETURN NEW;
END $$;
CREATE TRIGGER t_log_claim BEFORE UPDATE ON jobs FOR EACH ROW
    WHEN (OLD.status = 'queued' AND NEW.status = 'running') EXECUTE FUNCTION t_log_claim();
"""


def _tries(jobs_db: str) -> int:
    last_value, is_called = rows(jobs_db, "SELECT last_value, is_called FROM t_claims_tried")[0]
    return int(last_value) if is_called else 0


def _events(logged: list[dict[str, Any]], *names: str) -> list[dict[str, Any]]:
    return [e for e in logged if e["event"] in names]


def test_a_trigger_whose_table_was_dropped_refuses_the_claim_with_back_off_and_loses_nothing(conn, jobs_db) -> None:
    conn.execute(CLAIM_LOG)
    logged: list[dict[str, Any]] = []
    release = threading.Event()
    pool = _pool(jobs_db, {"slow": lambda ctx: release.wait(20) and "slow", "ok": lambda ctx: "fine"}, logged)
    pool.start()
    try:
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="slow", payload={})])
        wait_until(lambda: _jobs(jobs_db) == [("slow", "running", 1)], timeout_s=20, message="claimed")
        conn.execute("DROP TABLE t_claim_log")
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={}) for _ in range(3)])
        wait_until(lambda: _tries(jobs_db) >= 2, timeout_s=20, message="a claim was refused")
        first = time.monotonic()
        # Tried again with back-off, not at every poll (0.05 s).
        wait_until(lambda: _tries(jobs_db) >= 4, timeout_s=20, message="refused again")
        assert time.monotonic() - first >= 0.5, "the refused claim was tried again without back-off"
        health = wait_until(lambda: (h := pool.health()).refusals.get("claim", 0) >= 2 and h, timeout_s=5,
                            message=lambda: f"the pool's health says so: {pool.health()}")
        assert not health.ready and pool.error is None, health
        assert len(health.reasons) == 1, health
        assert 'relation "t_claim_log" does not exist' in health.reasons[0], health
        assert "t_log_claim()" in health.reasons[0] and "migrate" not in health.reasons[0], health
        assert _sample(pool, "outbox_jobs_dispatch_refused", "claim") == 1.0
        assert _sample(pool, "outbox_jobs_dispatch_refusals_total", "claim") >= 2
        release.set()  # a running job's success is still written
        wait_until(lambda: _jobs(jobs_db)[0] == ("slow", "succeeded", 1), timeout_s=10,
                   message=lambda: f"the success was written: {_jobs(jobs_db)}")
        assert _jobs(jobs_db)[1:] == [("ok", "queued", 0)] * 3  # nothing claimed, no attempt counted
        conn.execute("CREATE TABLE t_claim_log (job_id bigint NOT NULL)")
        wait_until(lambda: _jobs(jobs_db)[1:] == [("ok", "succeeded", 1)] * 3, timeout_s=40,
                   message=lambda: f"claimed once the table is back: {_jobs(jobs_db)}")
        wait_until(lambda: pool.health().ready, timeout_s=5, message=lambda: str(pool.health()))
        assert _sample(pool, "outbox_jobs_dispatch_refused", "claim") == 0.0
    finally:
        release.set()
        pool.stop()
    refused = _events(logged, "dispatch_refused")
    assert len(refused) == 1, refused  # once for the cause, although each try named another job
    assert (refused[0]["statement"], refused[0]["sqlstate"]) == ("claim", "42P01"), refused
    assert "create it again or fix the function" in refused[0]["hint"], refused
    assert len(_events(logged, "dispatch_resumed")) == 1
    assert not _events(logged, "dispatch_failed", "dispatch_crashed")
    assert dict(pool.outcomes) == {"succeeded": 4}


def test_the_jobs_tables_missing_at_the_start_or_while_the_pool_runs_are_refusals_until_they_are_back(
        conn, jobs_db) -> None:
    logged: list[dict[str, Any]] = []
    conn.execute("ALTER TABLE jobs RENAME TO t_jobs_away")  # not migrated yet, as far as the pool can see
    pool = _pool(jobs_db, {"ok": lambda ctx: "fine"}, logged)
    pool.start()
    try:
        health = wait_until(lambda: (h := pool.health()).refusals.get("claim", 0) >= 2 and h, timeout_s=20,
                            message=lambda: f"the pool's health says so: {pool.health()}")
        assert not health.ready and pool.error is None, health
        assert 'the jobs schema is missing (relation "jobs" does not exist)' in health.reasons[0], health
        assert "run `outbox-relay migrate`" in health.reasons[0], health
        assert _sample(pool, "outbox_jobs_dispatch_refused", "claim") == 1.0
        conn.execute("ALTER TABLE t_jobs_away RENAME TO jobs")
        # Ready again with nothing to claim: the check of the jobs tables passed.
        wait_until(lambda: pool.health().ready, timeout_s=20, message=lambda: str(pool.health()))
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={}) for _ in range(2)])
        wait_until(lambda: _jobs(jobs_db) == [("ok", "succeeded", 1)] * 2, timeout_s=20,
                   message=lambda: f"claimed: {_jobs(jobs_db)}")
        # Gone while the pool runs (its lanes, its claims, its reaps meet it): the same.
        conn.execute("ALTER TABLE jobs RENAME TO t_jobs_away")
        wait_until(lambda: not pool.health().ready, timeout_s=20, message=lambda: str(pool.health()))
        assert "the jobs schema is missing" in pool.health().reasons[0], pool.health()
        conn.execute("ALTER TABLE t_jobs_away RENAME TO jobs")
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={})])
        wait_until(lambda: _jobs(jobs_db) == [("ok", "succeeded", 1)] * 3, timeout_s=40,
                   message=lambda: f"claimed once the table is back: {_jobs(jobs_db)}")
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
    conn.execute(CLAIM_LOG)
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
