"""A reconcile step past the pool's statement_timeout is skipped, named, and the round claims
(consumer_sdk/jobs/reconciler.py; real PostgreSQL).

Another session holds job_dead_letters locked (what a migration, an operator's LOCK TABLE or a
large scan does to a step's statement): the reap, whose statement writes dead letters, waits
past the pool's timeout (0.3 s) and is cancelled.  Before, the whole round failed with it, at
every reconcile: no claim, ``dispatch_failed`` for upkeep the claim does not need, and the
gauges (the pass's last step) never refreshed.
"""

from __future__ import annotations

import time
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
    assert "pool_statement_timeout_s" in skipped["hint"] and "next_try_in_s" in skipped["hint"]
    assert pending == 1.0  # the step after it ran: the gauges were refreshed (the job was still ready)
    timed_out = {step: pool.metrics.registry.get_sample_value("outbox_jobs_reconcile_timed_out_total", {"step": step})
                 for step in ("resume", "reap", "stats")}
    assert timed_out == {"resume": 0.0, "reap": 1.0, "stats": 0.0}, timed_out


def test_a_step_that_keeps_timing_out_is_held_off_and_named_when_it_passes_again(conn, jobs_db) -> None:
    """Tried again at every pass and reap, a step that always times out held the dispatcher
    most of the time (its wait, then a pass due again at once): it waits four times its cost,
    doubled while it keeps timing out."""
    logged: list[dict[str, Any]] = []
    ahead = [0.0]  # the pool's clock, moved on by the test

    def clock() -> float:
        return time.monotonic() + ahead[0]

    config = WorkerConfig(dsn=jobs_db, queues=("q",), listen=False, pool_statement_timeout_s=0.3,
                          poll_interval_s=1.0, reconcile_interval_s=10.0)
    pool = WorkerPool(config, {"k": lambda ctx: None}, log=recording_logger(logged), clock=clock)
    upkeep, conn_of = pool._upkeep, pool._dispatch_slot.get  # noqa: SLF001 - the round's upkeep alone

    def timeouts() -> list[dict[str, Any]]:
        return [e for e in logged if e["event"] == "reconcile_timed_out"]

    try:
        with psycopg.connect(jobs_db) as locker:
            locker.execute("LOCK TABLE job_dead_letters IN ACCESS EXCLUSIVE MODE")
            upkeep.run_due(conn_of(), clock())  # the pass: its reap times out
            ahead[0] += 1.0  # a reap is due, the step is held off: nothing sent, nothing waited for
            upkeep.run_due(conn_of(), clock())
            [first] = timeouts()
            assert first["in_a_row"] == 1 and 1.0 <= first["next_try_in_s"] < 10, first
            ahead[0] += first["next_try_in_s"] + 1.0  # held no more: tried, timed out again, held longer
            upkeep.run_due(conn_of(), clock())
            second = timeouts()[-1]
            assert second["step"] == "reap" and second["in_a_row"] == 2, timeouts()
            assert second["next_try_in_s"] > first["next_try_in_s"] * 1.5, timeouts()
            locker.rollback()
        ahead[0] += 60.0  # the next pass: the reap passes again
        upkeep.run_due(conn_of(), clock())
        assert len(timeouts()) == 2, timeouts()
        # Counted at each timeout, not at each pass or reap it was held off for.
        assert pool.metrics.registry.get_sample_value("outbox_jobs_reconcile_timed_out_total", {"step": "reap"}) == 2.0
        [recovered] = [e for e in logged if e["event"] == "reconcile_step_recovered"]
        assert recovered["step"] == "reap" and recovered["timed_out_in_a_row"] == 2, recovered
    finally:
        pool.stop(drain_timeout_s=0.5)
