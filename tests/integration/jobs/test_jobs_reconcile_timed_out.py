"""A reconcile step past the pool's statement_timeout is skipped, named, and the round claims
(consumer_sdk/jobs/reconciler.py; real PostgreSQL).

Another session holds job_dead_letters locked (what a migration, an operator's LOCK TABLE or a
large scan does to a step's statement): the reap, whose statement writes dead letters, waits
past the pool's timeout (0.3 s) and is cancelled.  Before, the whole round failed with it, at
every reconcile: no claim, ``dispatch_failed`` for upkeep the claim does not need, and the
gauges (the pass's last step) never refreshed.
"""

from __future__ import annotations

from typing import Any

import psycopg

from consumer_sdk.jobs import NewJob, WorkerConfig, WorkerPool, enqueue
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import job_status, recording_logger


def test_a_reap_past_the_pools_timeout_is_skipped_and_the_round_claims(conn, jobs_db) -> None:
    logged: list[dict[str, Any]] = []
    [job] = enqueue(conn, [NewJob(owner_id="o", queue="q", kind="k", payload={})])
    config = WorkerConfig(dsn=jobs_db, queues=("q",), max_concurrency=1, listen=False, pool_statement_timeout_s=0.3)
    pool = WorkerPool(config, {"k": lambda ctx: None}, log=recording_logger(logged))
    try:
        with psycopg.connect(jobs_db) as locker:
            locker.execute("LOCK TABLE job_dead_letters IN ACCESS EXCLUSIVE MODE")  # held until the block ends
            claimed = pool.run_once()  # the first round reconciles
            pending = pool.metrics.registry.get_sample_value("outbox_jobs_pending", {"queue": "q"})
            locker.rollback()
        assert claimed == 1, logged
        pool.start()  # its executors run the job claimed
        wait_until(lambda: job_status(jobs_db, job) == "succeeded", timeout_s=10, message="the job never ran")
    finally:
        pool.stop(drain_timeout_s=0.5)
    [skipped] = [e for e in logged if e["event"] == "reconcile_timed_out"]
    assert skipped["step"] == "reap", skipped
    assert "statement_timeout cancelled the statement" in skipped["error"], skipped
    assert "pool_statement_timeout_s" in skipped["hint"] and "reconcile_interval_s" in skipped["hint"]
    assert pending == 1.0  # the step after it ran: the gauges were refreshed (the job was still ready)
