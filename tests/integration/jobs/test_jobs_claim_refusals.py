"""The database refusing a worker pool's own statements (its claim, its reap), for as long as a
person leaves it so, on a real PostgreSQL: a trigger that raises, a grant revoked.

Each round met the refusal, logged ``dispatch_failed`` and tried again after at most
``poll_interval_s``, for ever: no metric, no state a readiness probe could read, a log line
per round; a refused reap stopped every claim too, the queue served by no one.  Now the
statement is tried again with back-off, each distinct cause is logged once with the
database's words (``dispatch_refused``; ``dispatch_resumed`` when it passes), the pool's
health says it is not ready and why, successes are still written, a refused reap leaves
the claims running, and nothing is lost: once the database lets the claim pass, every
job runs, its first attempt.  A missing grant stops the pool (``PrivilegeMissing``), and
its health says so.
"""

from __future__ import annotations

import time
from typing import Any

from consumer_sdk.jobs import NewJob, PrivilegeMissing, enqueue
from consumer_sdk.jobs import queue as jobq
from consumer_sdk.jobs.model import Take
from tests.fixtures.procs import wait_until
from tests.integration.jobs._refused_claims import (
    claims_tried,
    job_rows,
    on_every_claim,
    pool_of,
    refuse_claims_while_a_job_runs,
)
from tests.integration.jobs.test_jobs_refusals import _role_lacking

#: Refuses every claim (after counting it) with a message that names the row, as a trigger's often does.
REFUSE_CLAIMS = "RAISE EXCEPTION 'job % may not start: the queue is frozen by policy', NEW.id;"

#: Refuses the reaper's requeue of an expired job (running back to queued), by a CHECK.
REFUSE_REAPS = ("ALTER TABLE jobs ADD CONSTRAINT t_never_requeued CHECK (status <> 'queued' OR lease_owner IS NULL "
                "OR lease_owner <> 'a-dead-worker') NOT VALID")


def test_a_claim_the_database_refuses_backs_off_says_so_and_loses_nothing(conn, jobs_db) -> None:
    seen = refuse_claims_while_a_job_runs(
        conn, jobs_db, refuse=lambda: on_every_claim(conn, "t_refuse_claim", REFUSE_CLAIMS),
        let_through=lambda: conn.execute("DROP TRIGGER t_refuse_claim ON jobs"),
        refusals=lambda: claims_tried(jobs_db, "t_refuse_claim"))
    # Not ready, and why, in the database's words.
    assert "the queue is frozen by policy" in seen.reason, seen
    assert seen.refused["sqlstate"] == "P0001", seen
    assert "may not start: the queue is frozen by policy" in seen.refused["error"], seen


def test_a_reap_the_database_refuses_leaves_the_claims_running(conn, jobs_db) -> None:
    # A job whose lease expired under a dead worker; the database refuses its requeue.
    enqueue(conn, [NewJob(owner_id="dead", queue="bulk", kind="ok", payload={})])
    jobq.claim(conn, worker="a-dead-worker", takes=[Take("bulk", "dead", 1, jobq.NO_OWNER_LIMIT)], lease_s=30)
    conn.execute("UPDATE jobs SET lease_until = now() - interval '1 minute'")
    conn.execute(REFUSE_REAPS)
    logged: list[dict[str, Any]] = []
    pool = pool_of(jobs_db, {"ok": lambda ctx: "fine"}, logged)
    started = time.monotonic()
    pool.start()
    try:
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={}) for _ in range(3)])
        wait_until(lambda: job_rows(jobs_db)[1:] == [("ok", "succeeded", 1)] * 3, timeout_s=20,
                   message=lambda: f"the pool claims on: {job_rows(jobs_db)} {[e['event'] for e in logged]}")
        health = pool.health()
        assert not health.ready and "t_never_requeued" in " ".join(health.reasons), health
        assert health.refusals.get("reap", 0) >= 1 and "claim" not in health.refusals, health
        # Tried again with back-off, not at every round (0.05 s): at most a few in these seconds.
        assert health.refusals["reap"] <= 2 + time.monotonic() - started, health
        assert job_rows(jobs_db)[0] == ("ok", "running", 1)  # left as it is for the next pass
        conn.execute("ALTER TABLE jobs DROP CONSTRAINT t_never_requeued")
        wait_until(lambda: job_rows(jobs_db)[0] == ("ok", "succeeded", 2), timeout_s=20,
                   message=lambda: f"reaped and run again: {job_rows(jobs_db)}")
        wait_until(lambda: pool.health().ready, timeout_s=5, message=lambda: str(pool.health()))
    finally:
        pool.stop()
    refused = [e for e in logged if e["event"] == "dispatch_refused"]
    assert [(e["statement"], e["sqlstate"]) for e in refused] == [("reap", "23514")], refused


def test_a_claim_without_its_grant_stops_the_pool_and_its_health_says_so(conn, jobs_db) -> None:
    logged: list[dict[str, Any]] = []
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={}) for _ in range(2)])
    with _role_lacking(jobs_db, "jobs") as dsn:
        pool = pool_of(dsn, {"ok": lambda ctx: "fine"}, logged)
        assert not pool.health().ready  # not started
        pool.start()
        try:
            wait_until(lambda: pool.error is not None, timeout_s=20, message="the pool failed")
            assert isinstance(pool.error, PrivilegeMissing)
            assert "permission denied for table jobs" in str(pool.error)
            health = pool.health()
            assert not health.ready and health.reasons == (f"failed: {pool.error}",), health
        finally:
            pool.stop()
    assert job_rows(jobs_db) == [("ok", "queued", 0)] * 2
    assert [e["error_type"] for e in logged if e["event"] == "pool_failed"] == ["PrivilegeMissing"]
    assert not [e for e in logged if e["event"] in ("dispatch_failed", "dispatch_refused")]

