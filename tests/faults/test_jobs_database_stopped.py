"""A worker pool whose PostgreSQL is stopped, with jobs running, and started again.

Each dispatch round failed, logged ``dispatch_failed`` and went on, and ``health()`` said ready
all along (an audit of the pool).  Here a real PostgreSQL (the restartable ``own_pg``) is
stopped under a pool running two jobs with a third waiting: the pool must be not ready with
the reason, its gauge 1, one ``dispatch_failed`` line for the outage; once the server is back,
ready again, one ``dispatch_recovered``, and every job succeeded once (its handler run once,
its success written once: the audit trigger's rows).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import psycopg

from consumer_sdk.jobs import JobsMetrics, NewJob, WorkerConfig, WorkerPool, enqueue
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import migrate_jobs_db, recording_logger, rows

GAUGE = "outbox_jobs_database_unavailable"


def _succeeded(dsn: str) -> int:
    return int(rows(dsn, "SELECT count(*) FROM jobs WHERE status = 'succeeded'")[0][0])


def test_a_pool_whose_postgresql_stops_is_not_ready_until_it_is_back_and_loses_no_job(
        own_db_dsn: str, own_pg_running: Any) -> None:
    dsn = migrate_jobs_db(own_db_dsn)
    release = threading.Event()
    ran: Counter[int] = Counter()
    lock = threading.Lock()

    def work(ctx: Any) -> str:
        with lock:
            ran[int(ctx.job.id)] += 1
        release.wait(30)  # still running when the server stops; returns while it is down
        return "done"

    logged: list[dict[str, Any]] = []
    metrics = JobsMetrics()
    config = WorkerConfig(dsn=dsn, max_concurrency=2, lease_duration_s=20.0, poll_interval_s=0.1,
                          reconcile_interval_s=0.5, listen=False, drain_timeout_s=1.0)
    pool = WorkerPool(config, {"work": work}, metrics=metrics, log=recording_logger(logged))
    pool.start()
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="work", payload={}) for _ in range(3)])
        wait_until(lambda: sum(ran.values()) == 2, timeout_s=20, message="two jobs running")
        assert pool.health().ready
        stopped_at = time.monotonic()
        own_pg_running.stop()
        release.set()  # their successes wait for the database
        health = wait_until(lambda: h if not (h := pool.health()).ready and h.failed_rounds >= 5 else None,
                            timeout_s=20, message=lambda: f"still ready with PostgreSQL stopped: {pool.health()}")
        assert any(r.startswith("the database is unavailable") and "dispatch rounds failed in a row" in r
                   for r in health.reasons), health
        assert metrics.registry.get_sample_value(GAUGE) == 1.0
        failed = [e for e in logged if e["event"] == "dispatch_failed" and e["at"] >= stopped_at]
        assert len(failed) == 1 and failed[0]["error_type"] == "DatabaseUnavailable", failed
        own_pg_running.start()  # returns once the server accepts connections
        wait_until(lambda: pool.health().ready, timeout_s=20, message=lambda: str(pool.health()))
        assert metrics.registry.get_sample_value(GAUGE) == 0.0
        wait_until(lambda: _succeeded(dsn) == 3, timeout_s=30,
                   message=lambda: str(rows(dsn, "SELECT id, status, attempts FROM jobs")))
    finally:
        release.set()
        own_pg_running.start()
        pool.stop()
    recovered = [e for e in logged if e["event"] == "dispatch_recovered"]
    assert len(recovered) == 1 and recovered[0]["rounds"] >= 5, recovered
    assert len([e for e in logged if e["event"] == "dispatch_failed" and e["at"] >= stopped_at]) == 1
    ids = [r[0] for r in rows(dsn, "SELECT id FROM jobs ORDER BY id")]
    assert dict(ran) == dict.fromkeys(ids, 1), ran
    assert rows(dsn, "SELECT job_id, count(*) FROM job_audit WHERE status = 'succeeded' GROUP BY 1 ORDER BY 1") == \
        [(i, 1) for i in ids]
    assert dict(pool.outcomes) == {"succeeded": 3}
