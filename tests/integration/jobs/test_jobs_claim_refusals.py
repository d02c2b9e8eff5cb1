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

import threading
import time
from typing import Any

from consumer_sdk.jobs import NewJob, PrivilegeMissing, WorkerConfig, WorkerPool, enqueue
from consumer_sdk.jobs import queue as jobq
from consumer_sdk.jobs.model import Take
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import recording_logger, rows
from tests.integration.jobs.test_jobs_refusals import _role_lacking

FAST = {"poll_interval_s": 0.05, "reconcile_interval_s": 0.5, "listen": False, "drain_timeout_s": 1.0}

#: Refuses every claim (a queued job becoming running) with a message that names the row, as
#: a trigger's often does; counts its refusals in a sequence (not rolled back with them).
REFUSE_CLAIMS = """
CREATE SEQUENCE t_claims_refused;
CREATE FUNCTION t_refuse_claim() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval('t_claims_refused');
    RAISE EXCEPTION 'job % may not start: the queue is frozen by policy', NEW.id;
END $$;
CREATE TRIGGER t_refuse_claim BEFORE UPDATE ON jobs FOR EACH ROW
    WHEN (OLD.status = 'queued' AND NEW.status = 'running') EXECUTE FUNCTION t_refuse_claim();
"""

#: Refuses the reaper's requeue of an expired job (running back to queued), by a CHECK.
REFUSE_REAPS = ("ALTER TABLE jobs ADD CONSTRAINT t_never_requeued CHECK (status <> 'queued' OR lease_owner IS NULL "
                "OR lease_owner <> 'a-dead-worker') NOT VALID")


def _refusals(jobs_db: str) -> int:
    last_value, is_called = rows(jobs_db, "SELECT last_value, is_called FROM t_claims_refused")[0]
    return int(last_value) if is_called else 0


def _jobs(jobs_db: str) -> list[tuple[Any, ...]]:
    return rows(jobs_db, "SELECT kind, status, attempts FROM jobs ORDER BY id")


def _pool(jobs_db: str, handlers: dict[str, Any], logged: list[dict[str, Any]], **options: Any) -> WorkerPool:
    config = WorkerConfig(**{"dsn": jobs_db, "max_concurrency": 2, "lease_duration_s": 30.0, **FAST, **options})
    return WorkerPool(config, handlers, log=recording_logger(logged))


def _sample(pool: Any, name: str, statement: str) -> float | None:
    return pool.metrics.registry.get_sample_value(name, {"statement": statement})


def test_a_claim_the_database_refuses_backs_off_says_so_and_loses_nothing(conn, jobs_db) -> None:
    logged: list[dict[str, Any]] = []
    release = threading.Event()
    pool = _pool(jobs_db, {"slow": lambda ctx: release.wait(20) and "slow", "ok": lambda ctx: "fine"}, logged)
    pool.start()
    try:
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="slow", payload={})])
        wait_until(lambda: _jobs(jobs_db) == [("slow", "running", 1)], timeout_s=20, message="claimed")
        conn.execute(REFUSE_CLAIMS)
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={}) for _ in range(3)])
        wait_until(lambda: _refusals(jobs_db) >= 1, timeout_s=20, message="a claim was refused")
        first = time.monotonic()
        # Tried again with back-off, not at every poll (0.05 s): three refusals take a while.
        wait_until(lambda: _refusals(jobs_db) >= 3, timeout_s=20, message="refused again")
        assert time.monotonic() - first >= 0.5, "the refused claim was tried again without back-off"
        # Not ready, and why, in the database's words.
        health = wait_until(lambda: (h := pool.health()).refusals.get("claim", 0) >= 3 and h, timeout_s=5,
                            message=lambda: str(pool.health()))
        assert not health.ready and pool.error is None, health
        assert len(health.reasons) == 1 and "the queue is frozen by policy" in health.reasons[0], health
        # And the metrics an alert reads (OutboxJobsDispatchRefused).
        assert _sample(pool, "outbox_jobs_dispatch_refused", "claim") == 1.0
        assert _sample(pool, "outbox_jobs_dispatch_refusals_total", "claim") >= 3
        # A success is still written while the claims are refused.
        release.set()
        wait_until(lambda: _jobs(jobs_db)[0] == ("slow", "succeeded", 1), timeout_s=5,
                   message=lambda: f"the success was written: {_jobs(jobs_db)}")
        assert not pool.health().ready
        # Nothing was claimed meanwhile: no attempt counted.
        assert _jobs(jobs_db)[1:] == [("ok", "queued", 0)] * 3
        conn.execute("DROP TRIGGER t_refuse_claim ON jobs")
        wait_until(lambda: _jobs(jobs_db)[1:] == [("ok", "succeeded", 1)] * 3, timeout_s=40,
                   message=lambda: f"claimed once the database let it: {_jobs(jobs_db)}")
        wait_until(lambda: pool.health().ready, timeout_s=5, message=lambda: str(pool.health()))
        assert pool.health().refusals["claim"] >= 3  # a counter: what was refused stays counted
        assert _sample(pool, "outbox_jobs_dispatch_refused", "claim") == 0.0
    finally:
        release.set()
        pool.stop()
    refused = [e for e in logged if e["event"] == "dispatch_refused"]
    # Logged once for the cause, although each refusal named another job.
    assert len(refused) == 1, refused
    assert refused[0]["statement"] == "claim" and refused[0]["sqlstate"] == "P0001"
    assert "may not start: the queue is frozen by policy" in refused[0]["error"]
    assert [e["event"] for e in logged if e["event"] == "dispatch_resumed"] == ["dispatch_resumed"]
    assert not [e for e in logged if e["event"] == "dispatch_failed"]
    assert dict(pool.outcomes) == {"succeeded": 4}


def test_a_reap_the_database_refuses_leaves_the_claims_running(conn, jobs_db) -> None:
    # A job whose lease expired under a dead worker; the database refuses its requeue.
    enqueue(conn, [NewJob(owner_id="dead", queue="bulk", kind="ok", payload={})])
    jobq.claim(conn, worker="a-dead-worker", takes=[Take("bulk", "dead", 1, jobq.NO_OWNER_LIMIT)], lease_s=30)
    conn.execute("UPDATE jobs SET lease_until = now() - interval '1 minute'")
    conn.execute(REFUSE_REAPS)
    logged: list[dict[str, Any]] = []
    pool = _pool(jobs_db, {"ok": lambda ctx: "fine"}, logged)
    started = time.monotonic()
    pool.start()
    try:
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={}) for _ in range(3)])
        wait_until(lambda: _jobs(jobs_db)[1:] == [("ok", "succeeded", 1)] * 3, timeout_s=20,
                   message=lambda: f"the pool claims on: {_jobs(jobs_db)} {[e['event'] for e in logged]}")
        health = pool.health()
        assert not health.ready and "t_never_requeued" in " ".join(health.reasons), health
        assert health.refusals.get("reap", 0) >= 1 and "claim" not in health.refusals, health
        # Tried again with back-off, not at every round (0.05 s): at most a few in these seconds.
        assert health.refusals["reap"] <= 2 + time.monotonic() - started, health
        assert _jobs(jobs_db)[0] == ("ok", "running", 1)  # left as it is for the next pass
        conn.execute("ALTER TABLE jobs DROP CONSTRAINT t_never_requeued")
        wait_until(lambda: _jobs(jobs_db)[0] == ("ok", "succeeded", 2), timeout_s=20,
                   message=lambda: f"reaped and run again: {_jobs(jobs_db)}")
        wait_until(lambda: pool.health().ready, timeout_s=5, message=lambda: str(pool.health()))
    finally:
        pool.stop()
    refused = [e for e in logged if e["event"] == "dispatch_refused"]
    assert [(e["statement"], e["sqlstate"]) for e in refused] == [("reap", "23514")], refused


def test_a_claim_without_its_grant_stops_the_pool_and_its_health_says_so(conn, jobs_db) -> None:
    logged: list[dict[str, Any]] = []
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={}) for _ in range(2)])
    with _role_lacking(jobs_db, "jobs") as dsn:
        pool = _pool(dsn, {"ok": lambda ctx: "fine"}, logged)
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
    assert _jobs(jobs_db) == [("ok", "queued", 0)] * 2
    assert [e["error_type"] for e in logged if e["event"] == "pool_failed"] == ["PrivilegeMissing"]
    assert not [e for e in logged if e["event"] in ("dispatch_failed", "dispatch_refused")]

