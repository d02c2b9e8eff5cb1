"""WorkerConfig.max_interruptions reaches the pool's executor (consumer_sdk/jobs/worker.py; real
PostgreSQL): with 0, a handler whose connection broke counts its attempt, as the setting says."""

from __future__ import annotations

from typing import Any

from consumer_sdk.jobs import Backoff, NewJob, WorkerConfig, WorkerPool, enqueue
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import recording_logger, rows


def test_a_pool_with_max_interruptions_0_counts_an_attempt_whose_connection_broke(conn, jobs_db) -> None:
    events: list[dict[str, Any]] = []
    runs: list[int] = []

    def work(ctx: Any) -> str:
        runs.append(ctx.job.attempts)
        if len(runs) == 1:  # its own backend ended under it, as a failover or an administrator would
            ctx.conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        return "done"

    config = WorkerConfig(dsn=jobs_db, max_concurrency=1, poll_interval_s=0.05, listen=False, drain_timeout_s=1.0,
                          backoff=Backoff(initial_s=0.05, max_s=0.05), max_interruptions=0)
    pool = WorkerPool(config, {"work": work}, log=recording_logger(events))
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="work", payload={}, max_attempts=1)])
    pool.start()
    try:
        wait_until(lambda: rows(jobs_db, "SELECT status FROM jobs")[0][0] in ("succeeded", "failed"), timeout_s=20,
                   message=lambda: f"the job never ended: {[e['event'] for e in events]}")
    finally:
        pool.stop()
    assert rows(jobs_db, "SELECT status, attempts, interruptions FROM jobs") == [("failed", 1, 0)]
    assert runs == [1] and not [e for e in events if e["event"] == "job_given_back"], events
