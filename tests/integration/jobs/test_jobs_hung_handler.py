"""A handler that never returns, on a real PostgreSQL: a person is told.

A handler stuck for ever (an HTTP call without a timeout, a deadlock) kept its job and its
worker slot: the heartbeat renewed its lease at every round and nothing said so (no metric
of a running attempt's age, no log, no alert).  Now the pool's gauge
``outbox_jobs_oldest_running_age_seconds{queue}`` grows with it, and ``job_running_long``
is logged once for the attempt past ``running_long_after_s``.  With ``handler_timeout_s``
(opt-in) the attempt fails at the limit: retried or dead-lettered by the pool, with the
reason, under its lease token, and the gauge ``outbox_jobs_handlers_stuck`` counts the handlers
that ignore it and keep their slots.
"""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

from consumer_sdk.jobs import Backoff, NewJob, WorkerConfig, WorkerPool, enqueue
from consumer_sdk.jobs.errors import LeaseLost
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import job_status, recording_logger, rows, scalar


def _heartbeat_at(jobs_db: str, job_id: int) -> dt.datetime | None:
    value = scalar(jobs_db, "SELECT heartbeat_at FROM jobs WHERE id = %s", (job_id,))
    return value if isinstance(value, dt.datetime) else None


def test_a_hung_handler_shows_in_the_age_gauge_and_is_logged_once(conn, jobs_db) -> None:
    logged: list[dict[str, Any]] = []
    release = threading.Event()  # stands for a call that never returns; set only to end the test
    config = WorkerConfig(dsn=jobs_db, max_concurrency=2, lease_duration_s=3.0, heartbeat_interval_s=0.2,
                          poll_interval_s=0.1, listen=False, drain_timeout_s=1.0, running_long_after_s=1.0)
    pool = WorkerPool(config, {"hang": lambda ctx: release.wait(60) and "released", "quick": lambda ctx: "ok"},
                      log=recording_logger(logged))

    def age() -> float:
        value = pool.metrics.registry.get_sample_value("outbox_jobs_oldest_running_age_seconds",
                                                      {"queue": "bulk"})
        assert value is not None, "no outbox_jobs_oldest_running_age_seconds{queue='bulk'}"
        return value

    pool.start()
    try:
        assert age() == 0.0  # nothing runs yet
        [hung] = enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="hang", payload={})])
        first = wait_until(lambda: _heartbeat_at(jobs_db, hung), timeout_s=20, message="hung job renewed")
        wait_until(lambda: (at := _heartbeat_at(jobs_db, hung)) is not None and at > first, timeout_s=20,
                   message="the hung job's lease was renewed again")  # the defect's own symptom
        wait_until(lambda: age() >= 2.5, timeout_s=30, message=lambda: f"the age gauge stayed at {age()}")
        long = [e for e in logged if e["event"] == "job_running_long"]
        assert len(long) == 1, long  # once per attempt, though the watch ran many times since 1 s
        assert long[0]["job_id"] == hung and long[0]["queue"] == "bulk" and long[0]["kind"] == "hang"
        assert long[0]["attempt"] == 1 and long[0]["running_s"] >= 1.0 and "not returned" in long[0]["detail"]
        # The other slot still works, and its quick job does not hide the hung one in the gauge.
        [quick] = enqueue(conn, [NewJob(owner_id="p", queue="bulk", kind="quick", payload={})])
        wait_until(lambda: job_status(jobs_db, quick) == "succeeded", timeout_s=20, message="quick job")
        assert age() >= 2.5
        assert job_status(jobs_db, hung) == "running"
        release.set()
        wait_until(lambda: job_status(jobs_db, hung) == "succeeded", timeout_s=20, message="released job")
        wait_until(lambda: age() == 0.0, timeout_s=10, message=lambda: f"the age gauge stayed at {age()}")
    finally:
        release.set()
        pool.stop()
    assert [e["job_id"] for e in logged if e["event"] == "job_running_long"] == [hung]


def test_a_handler_past_handler_timeout_s_fails_its_attempt_and_the_pool_runs_on(conn, jobs_db) -> None:
    """handler_timeout_s=1: the hung attempt is retried, or dead-lettered after its last
    attempt, with a readable reason, written by the pool under the attempt's token; its late
    fenced write is refused; the stuck threads are counted, not used; other jobs run."""
    logged: list[dict[str, Any]] = []
    release = threading.Event()  # the hung calls return only when the test ends
    late: list[str] = []

    def hang(ctx: Any) -> Any:
        if ctx.job.attempts == 1:
            release.wait(60)  # ignores ctx.cancelled, as a hung HTTP call would
            try:
                ctx.put_result("late", {"attempt": 1})
                late.append("written")
            except LeaseLost as exc:
                late.append(exc.reason)
        return {"attempt": ctx.job.attempts}

    config = WorkerConfig(dsn=jobs_db, max_concurrency=3, lease_duration_s=5.0, heartbeat_interval_s=0.2,
                          poll_interval_s=0.1, listen=False, drain_timeout_s=1.0, handler_timeout_s=1.0,
                          backoff=Backoff(initial_s=0.0, max_s=0.0))
    pool = WorkerPool(config, {"hang": hang, "quick": lambda ctx: "ok"}, log=recording_logger(logged))

    def stuck_gauge() -> float | None:
        return pool.metrics.registry.get_sample_value("outbox_jobs_handlers_stuck")

    pool.start()
    try:
        assert stuck_gauge() == 0.0
        [dead] = enqueue(conn, [NewJob(owner_id="a", queue="bulk", kind="hang", payload={}, max_attempts=1)])
        [retried] = enqueue(conn, [NewJob(owner_id="b", queue="bulk", kind="hang", payload={}, max_attempts=3)])
        wait_until(lambda: job_status(jobs_db, dead) == "failed", timeout_s=30, message="the hung job never failed")
        wait_until(lambda: job_status(jobs_db, retried) == "succeeded", timeout_s=30,
                   message=lambda: f"the retried job is {job_status(jobs_db, retried)}")
        assert pool.health().stuck_handlers == 2 and pool.health().ready  # 1 of 3 slots left, used
        assert stuck_gauge() == 2.0  # what a scrape shows
        quick = enqueue(conn, [NewJob(owner_id=f"q{i}", queue="bulk", kind="quick", payload={}) for i in range(3)])
        wait_until(lambda: all(job_status(jobs_db, j) == "succeeded" for j in quick), timeout_s=30,
                   message="the pool stopped running jobs")
        release.set()
        wait_until(lambda: pool.outcomes["timed_out"] == 2, timeout_s=20, message=lambda: str(pool.outcomes))
        assert pool.health().stuck_handlers == 0
        assert stuck_gauge() == 0.0
    finally:
        release.set()
        pool.stop()
    error = "HandlerTimedOut: handler timed out after 1 s"
    assert rows(jobs_db, "SELECT reason, error, error_type, attempts FROM job_dead_letters WHERE job_id = %s",
                (dead,)) == [("attempts_exhausted", error, "HandlerTimedOut", 1)]
    assert rows(jobs_db, "SELECT attempts, last_error, result FROM jobs WHERE id = %s", (retried,)) == [
        (2, error, {"attempt": 2})]
    assert late == ["timed_out", "timed_out"]  # the late writes were fenced out
    assert scalar(jobs_db, "SELECT count(*) FROM job_results") == 0
    timed_out = sorted((e["job_id"], e["outcome"]) for e in logged if e["event"] == "job_timed_out")
    assert timed_out == sorted([(dead, "failed"), (retried, "retried")])
    assert any(e["event"] == "handler_stuck" and "cannot kill" in e["detail"] for e in logged)
    assert pool.outcomes["failed"] == 1 and pool.outcomes["retried"] == 1 and pool.outcomes["succeeded"] == 4
    assert pool.metrics.registry.get_sample_value(
        "outbox_jobs_dead_lettered_total", {"queue": "bulk", "reason": "attempts_exhausted"}) == 1
