"""A worker pool whose database turns read-only (SQLSTATE 25006: a failover to a standby, a
primary demoted for maintenance), on a real PostgreSQL.

Here that is ``default_transaction_read_only`` set on the test's database and its sessions
ended, as a failover ends them; then set back, without ending the sessions this time: the
read-only ones must be left for new ones, as a multi-host DSN
(``target_session_attrs=read-write``) finds the new primary only on a new connection.

The pool's claim (or its reap) met 25006 as "jobs statement failed", a FatalError: the pool
stopped claiming for good (``pool.error``, health failed), and stayed so once the database was
writable again, until a person restarted the process.  The relay and the dedup consumer wait
for a read-only database as for an unreachable one; now the pool does too, on new
connections, and nothing is lost: every job runs once the database is writable, its first
attempt counted.
"""

from __future__ import annotations

from typing import Any

import psycopg

from consumer_sdk.jobs import NewJob, WorkerConfig, WorkerPool, enqueue
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import WRITABLE, recording_logger, rows, set_read_only


def _jobs(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True, options=WRITABLE) as conn:
        return conn.execute("SELECT kind, status, attempts FROM jobs ORDER BY id").fetchall()


def test_the_pool_waits_for_a_read_only_database_and_claims_once_it_is_writable(conn, jobs_db) -> None:
    logged: list[dict[str, Any]] = []
    config = WorkerConfig(dsn=jobs_db, max_concurrency=2, lease_duration_s=10.0, poll_interval_s=0.05,
                          reconcile_interval_s=0.5, listen=False, drain_timeout_s=1.0)
    pool = WorkerPool(config, {"ok": lambda ctx: "fine"}, log=recording_logger(logged))
    pool.start()
    try:
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={})])
        wait_until(lambda: _jobs(jobs_db) == [("ok", "succeeded", 1)], timeout_s=20, message="the first job ran")
        set_read_only(jobs_db, True, end_sessions=True)
        with psycopg.connect(jobs_db, autocommit=True, options=WRITABLE) as writer:
            enqueue(writer, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={}) for _ in range(3)])
        # dispatch_failed is logged once per outage (consumer_sdk.jobs.outage), not per round.
        wait_until(lambda: pool.health().failed_rounds >= 3 or pool.error is not None,
                   timeout_s=20, message=lambda: f"the pool met the read-only database: {logged[-3:]}")
        assert pool.error is None, f"the pool stopped: {pool.error!r}"
        assert [e for e in logged if e["event"] == "dispatch_failed" and "read-only" in str(e.get("error"))]
        assert _jobs(jobs_db)[1:] == [("ok", "queued", 0)] * 3  # nothing claimed meanwhile
        set_read_only(jobs_db, False, end_sessions=False)  # the read-only sessions stay read-only
        wait_until(lambda: _jobs(jobs_db)[1:] == [("ok", "succeeded", 1)] * 3, timeout_s=30,
                   message=lambda: f"claimed once writable: {_jobs(jobs_db)} {pool.error!r}")
        assert pool.health().ready, pool.health()
    finally:
        set_read_only(jobs_db, False, end_sessions=False)
        pool.stop()
    failed = [e for e in logged if e["event"] == "dispatch_failed"]
    assert all("the database is read-only" in e["error"] for e in failed if "read-only" in e["error"]), failed
    assert not [e for e in logged if e["event"] in ("pool_failed", "dispatch_crashed")]
    assert dict(pool.outcomes) == {"succeeded": 4}
    assert rows(jobs_db, "SELECT count(*) FROM job_dead_letters") == [(0,)]
