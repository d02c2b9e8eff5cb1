"""A handler that never returns, on a real PostgreSQL: a person is told.

A handler stuck for ever (an HTTP call without a timeout, a deadlock) kept its job and its
worker slot: the heartbeat renewed its lease at every round and nothing said so (no metric
of a running attempt's age, no log, no alert).  Now the pool's gauge
``outbox_jobs_oldest_running_age_seconds{queue}`` grows with it, and ``job_running_long``
is logged once for the attempt past ``running_long_after_s``.
"""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

from consumer_sdk.jobs import NewJob, WorkerConfig, WorkerPool, enqueue
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import job_status, recording_logger, scalar


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
