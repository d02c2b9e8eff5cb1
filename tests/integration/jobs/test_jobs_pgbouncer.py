"""A worker pool through PgBouncer in transaction mode (the real PgBouncer, a real PostgreSQL):
server sessions shared between the pool's connections, fewer of them than the pool's threads.

Every job runs once, its fenced writes (a fenced transaction, results by key) committed once,
and the pool says what it cannot do there: LISTEN does not survive a transaction pooler.
(test_jobs_worker.py raises the pooler's lost prepared statement in a handler.)
"""

from __future__ import annotations

from typing import Any

import pytest

from consumer_sdk.jobs import NewJob, WorkerConfig, WorkerPool, enqueue
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import recording_logger, rows
from tests.integration.test_pgbouncer import pgbouncer

__all__ = ["pgbouncer"]  # the fixture, used by name


def _by_status(jobs_db: str) -> list[tuple[Any, ...]]:
    return rows(jobs_db, "SELECT status, count(*) FROM jobs GROUP BY 1 ORDER BY 1")


def _work(ctx: Any) -> Any:
    with ctx.fenced_transaction() as tx:
        tx.execute("INSERT INTO effects (job_id, token, step, worker) VALUES (%s, %s, 1, %s)",
                   (ctx.job.id, ctx.job.token, ctx.job.worker))
    ctx.put_result("step-2", {"n": ctx.job.payload["n"]})
    return {"n": ctx.job.payload["n"]}


@pytest.mark.timeout(120)
def test_jobs_through_pgbouncer_in_transaction_mode_run_once(conn, jobs_db, pgbouncer) -> None:
    dsn = pgbouncer("transaction", pool_size=2)
    logged: list[dict[str, Any]] = []
    config = WorkerConfig(dsn=dsn, max_concurrency=3, lease_duration_s=10.0, poll_interval_s=0.2,
                          reconcile_interval_s=0.5, listen=True, drain_timeout_s=2.0)
    pool = WorkerPool(config, {"work": _work}, log=recording_logger(logged))
    pool.start()
    try:
        enqueue(conn, [NewJob(owner_id=f"o{n % 3}", queue="bulk", kind="work", payload={"n": n})
                       for n in range(40)])
        wait_until(lambda: _by_status(jobs_db) == [("succeeded", 40)], timeout_s=60,
                   message=lambda: f"{_by_status(jobs_db)} {[e['event'] for e in logged][-10:]}")
    finally:
        pool.stop()
    assert rows(jobs_db, "SELECT count(*), count(DISTINCT job_id) FROM effects") == [(40, 40)]
    assert rows(jobs_db, "SELECT count(*) FROM job_results") == [(40,)]
    assert rows(jobs_db, "SELECT max(attempts) FROM jobs") == [(1,)]
    bad = [e for e in logged if e["event"] in ("lease_lost", "job_attempt_failed", "job_write_failed",
                                               "dispatch_failed", "dispatch_crashed", "heartbeat_failed")]
    assert not bad, bad



def test_through_a_transaction_pooler_the_pool_says_it_does_not_listen_and_claims_at_its_poll(
        conn, jobs_db, pgbouncer) -> None:
    # LISTEN through PgBouncer in transaction mode: pool.listening said True and no
    # notification ever came (a job waited for the poll, 5 s by default, listen=True or not).
    dsn = pgbouncer("transaction", pool_size=2)
    logged: list[dict[str, Any]] = []
    config = WorkerConfig(dsn=dsn, max_concurrency=2, lease_duration_s=10.0, poll_interval_s=0.5,
                          reconcile_interval_s=5.0, listen=True, drain_timeout_s=2.0)
    pool = WorkerPool(config, {"work": _work}, log=recording_logger(logged))
    pool.start()
    try:
        wait_until(lambda: [e for e in logged if e["event"] == "listen_unavailable"], timeout_s=15,
                   message=lambda: f"the listener said so: {[e['event'] for e in logged]}")
        assert not pool.listening
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="work", payload={"n": 1})])
        wait_until(lambda: rows(jobs_db, "SELECT status FROM jobs") == [("succeeded",)], timeout_s=20,
                   message="claimed at the poll")
    finally:
        pool.stop()
    assert [e["event"] for e in logged].count("listen_unavailable") == 1
    assert not [e for e in logged if e["event"] in ("listen_failed", "listen_stopped")]
    assert not pool.listening
