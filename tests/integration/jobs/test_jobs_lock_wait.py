"""An operator's ``LOCK TABLE jobs`` under a running worker pool, seen by its lock-wait watch
(consumer_sdk/jobs/lock_waits.py; real PostgreSQL).

The dispatcher's claim and the heartbeat's lease renewal wait on the lock: the pool stopped
claiming and renewing without a word (no log line, no metric) while the leases ran out
under its running handlers.  Now each waiting session is named in ``jobs_lock_wait``, with
the backend that holds it up (the operator's pid and application_name), the gauge
``outbox_jobs_lock_wait_seconds{queue}`` rises, and both say it is over once the lock is
released.  The pool's own watch (``pool.lock_waits``, started with the pool, default timing:
it looks once a statement has been in flight 5 s), on the pool's log.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg

from consumer_sdk.jobs import NewJob, WorkerConfig, WorkerPool, enqueue
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import job_status, recording_logger

OPERATOR = "dba-maintenance"


def test_an_operators_lock_on_the_jobs_table_is_named_for_the_dispatcher_and_the_heartbeat(conn, jobs_db) -> None:
    logged: list[dict[str, Any]] = []
    release = threading.Event()  # the job runs while the table is locked
    config = WorkerConfig(dsn=jobs_db, max_concurrency=2, lease_duration_s=30.0, heartbeat_interval_s=0.2,
                          poll_interval_s=0.1, listen=False, drain_timeout_s=1.0)
    pool = WorkerPool(config, {"slow": lambda ctx: release.wait(60) and "done"}, log=recording_logger(logged))

    def gauge() -> float:
        value = pool.metrics.registry.get_sample_value("outbox_jobs_lock_wait_seconds", {"queue": "bulk"})
        assert value is not None, "the pool exports no outbox_jobs_lock_wait_seconds{queue='bulk'}"
        return value

    def waits(session: str) -> list[dict[str, Any]]:
        return [e for e in logged if e["event"] == "jobs_lock_wait" and e["session"] == session]

    operator = psycopg.connect(jobs_db, application_name=OPERATOR)  # not autocommit: the lock is held
    pool.start()
    try:
        assert gauge() == 0.0
        [job] = enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="slow", payload={})])
        wait_until(lambda: job_status(jobs_db, job) == "running", timeout_s=20, message="the job never ran")
        operator_pid = operator.info.backend_pid
        operator.execute("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")
        wait_until(lambda: waits("dispatcher") and waits("heartbeat"), timeout_s=30,
                   message=lambda: f"not both sessions named: {[e for e in logged if 'lock' in e['event']]}")
        seen = wait_until(lambda: gauge() >= 1.0 and gauge(), timeout_s=10,
                          message=lambda: f"the gauge stayed at {gauge()}")
        wait_until(lambda: gauge() > seen, timeout_s=10, message=lambda: f"the gauge stuck at {seen}")
        for session in ("dispatcher", "heartbeat"):
            [first] = waits(session)[:1]
            assert first["relation"] == "jobs" and first["mode"], first
            assert first["blocking_pids"] == [operator_pid] and first["blockers"] == [OPERATOR], first
            assert f"held by backend pid {operator_pid} ({OPERATOR}, idle in transaction)" in first["detail"], first
            assert "LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE" in first["detail"], first
        assert "renews no lease" in waits("heartbeat")[0]["hint"]
        operator.rollback()  # the operator's transaction ends: both go on
        wait_until(lambda: any(e["event"] == "jobs_lock_wait_over" for e in logged), timeout_s=20,
                   message="the end of the wait was not said")
        wait_until(lambda: gauge() == 0.0, timeout_s=20, message=lambda: f"the gauge stayed at {gauge()}")
        [over] = [e for e in logged if e["event"] == "jobs_lock_wait_over"]
        assert over["sessions"] == ["dispatcher", "heartbeat"] and over["blocking_pids"] == [operator_pid]
        release.set()
        wait_until(lambda: job_status(jobs_db, job) == "succeeded", timeout_s=20, message="the job never ended")
    finally:
        release.set()
        operator.close()
        pool.stop()
    assert gauge() == 0.0
