"""The worker pool's own sessions (consumer_sdk/jobs/_conn.py; real PostgreSQL): their
``statement_timeout`` (``pool_statement_timeout_s``), never the handler's, and the lock-wait
watch's connection named apart (``:watch``).

A pool statement slowed by something other than a lock (an overloaded server, a large scan)
was only seen as a round unanswered for 10 s.  Here a trigger that sleeps on the claim's
UPDATE (what a busy server or a heavy audit trigger does to it) makes the claim run past the
pool's timeout: the database cancels it, the pool says which statement and which setting,
claims nothing, counts no attempt, and claims the job once the claim is fast again.
"""

from __future__ import annotations

import threading
from typing import Any

from consumer_sdk.jobs import JobContext, NewJob, WorkerConfig, WorkerPool, enqueue
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import job_status, recording_logger, rows

SLOW_CLAIM = """
CREATE FUNCTION slow_claim() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(2); RETURN NEW; END $$;
CREATE TRIGGER slow_claim BEFORE UPDATE ON jobs FOR EACH ROW
    WHEN (OLD.status = 'queued' AND NEW.status = 'running') EXECUTE FUNCTION slow_claim();
"""


def test_a_claim_past_the_pools_statement_timeout_is_cancelled_named_and_tried_again(conn, jobs_db) -> None:
    logged: list[dict[str, Any]] = []
    seen: list[tuple[str, str]] = []

    def handler(ctx: JobContext) -> str:  # the handler's session keeps its own settings
        ctx.conn.execute("SELECT pg_sleep(0.6)")  # longer than the pool's timeout: not cancelled
        seen.append(ctx.conn.execute("SELECT current_setting('statement_timeout'), "
                                     "current_setting('application_name')").fetchone())
        return "done"

    conn.execute(SLOW_CLAIM)
    config = WorkerConfig(dsn=jobs_db, max_concurrency=1, poll_interval_s=0.2, listen=False,
                          pool_statement_timeout_s=0.5, drain_timeout_s=1.0, application_name="t-own-sessions")
    pool = WorkerPool(config, {"k": handler}, log=recording_logger(logged))
    [job] = enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="k", payload={})])
    pool.start()
    try:
        failed = wait_until(lambda: [e for e in logged if e["event"] == "dispatch_failed"], timeout_s=20,
                            message=lambda: f"no dispatch_failed: {logged}")[0]
        assert failed["error_type"] == "StatementTimedOut", failed
        assert failed["statement"].startswith("claim"), failed
        assert "statement_timeout cancelled the statement" in failed["error"], failed
        assert "pool_statement_timeout_s" in failed["error"] and "pool_statement_timeout_s" in failed["hint"]
        assert rows(jobs_db, "SELECT status, attempts FROM jobs WHERE id = %s", (job,)) == [("queued", 0)]
        assert not any(e["event"] in ("jobs_lock_wait", "job_failed", "job_attempt_failed") for e in logged)
        conn.execute("DROP TRIGGER slow_claim ON jobs")  # the claim is fast again: the pool goes on
        wait_until(lambda: job_status(jobs_db, job) == "succeeded", timeout_s=20,
                   message=lambda: f"the job never ran: {[e for e in logged if e['event'].startswith('dispatch')]}")
        assert any(e["event"] == "dispatch_recovered" for e in logged)
        assert seen == [("0", "t-own-sessions")], seen  # the database's default, not the pool's 500ms
        assert rows(jobs_db, "SELECT attempts FROM jobs WHERE id = %s", (job,)) == [(1,)]
    finally:
        pool.stop()


def test_a_lease_renewal_past_the_pools_statement_timeout_is_cancelled_and_named(conn, jobs_db) -> None:
    logged: list[dict[str, Any]] = []
    running, release = threading.Event(), threading.Event()

    def handler(ctx: JobContext) -> str:
        running.set()
        release.wait(20)
        return "done"

    conn.execute(SLOW_CLAIM.replace("OLD.status = 'queued'", "OLD.status = 'running'"))  # the renewal's UPDATE
    config = WorkerConfig(dsn=jobs_db, max_concurrency=1, poll_interval_s=0.2, listen=False, lease_duration_s=5.0,
                          heartbeat_interval_s=0.2, pool_statement_timeout_s=0.5, drain_timeout_s=1.0)
    pool = WorkerPool(config, {"k": handler}, log=recording_logger(logged))
    [job] = enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="k", payload={})])
    pool.start()
    try:
        assert running.wait(20), "the job never ran"
        failed = wait_until(lambda: [e for e in logged if e["event"] == "heartbeat_failed"], timeout_s=20,
                            message=lambda: f"no heartbeat_failed: {logged}")[0]
        assert "statement_timeout cancelled the statement" in failed["error"], failed
        assert "pool_statement_timeout_s" in failed["error"], failed
        conn.execute("DROP TRIGGER slow_claim ON jobs")
        release.set()
        wait_until(lambda: job_status(jobs_db, job) == "succeeded", timeout_s=20, message="the job never ended")
        assert not any(e["event"] in ("lease_lost", "job_failed") for e in logged)  # renewed in time after all
    finally:
        release.set()
        pool.stop()


def test_the_lock_wait_watch_connects_as_the_pool_with_watch_and_the_pools_statement_timeout(jobs_db) -> None:
    name = "t-" + "w" * 61  # 63 characters: cut so that the suffix stays
    config = WorkerConfig(dsn=jobs_db, listen=False, application_name=name, pool_statement_timeout_s=1.5)
    pool = WorkerPool(config, {"k": lambda ctx: None})
    watch = pool.lock_waits._connect()  # the factory of the watch's own connection (opened when it looks)
    try:
        found = watch.execute("SELECT a.application_name, current_setting('statement_timeout') "
                              "FROM pg_stat_activity AS a WHERE a.pid = pg_backend_pid()").fetchall()
        assert found == [(name[:57] + ":watch", "1500ms")], found
    finally:
        watch.close()
        pool.stop()
