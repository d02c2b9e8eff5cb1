"""An executor's idle connection ended by the server (a database restart, a failover,
``idle_session_timeout``, an administrator's ``pg_terminate_backend``), on a real PostgreSQL.

The executor kept the connection of its last job for its next one, and nothing notices a
connection the server ended while it sat idle until it is used: the next job's handler met
it dead.  Its first fenced write read the broken connection as a lost lease (authority can
no longer be proven): ``lease_lost``, nothing written, the job left to its lease, then
requeued by the reaper with the attempt counted or, on its last attempt, failed with a
``lease_expired`` dead letter; a handler that reads first failed with the driver's error
and was retried with back-off.  Now an executor's connection found ended (the server's
goodbye waiting on its socket) is replaced before the job starts.
"""

from __future__ import annotations

from typing import Any

import psycopg

from consumer_sdk.jobs import NewJob, WorkerConfig, WorkerPool, enqueue
from consumer_sdk.jobs._conn import _readable, ended
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import recording_logger, rows


def _jobs(jobs_db: str) -> list[tuple[Any, ...]]:
    return rows(jobs_db, "SELECT status, attempts, last_error FROM jobs ORDER BY id")


def _end_sessions(conn: Any, application_name: str) -> int:
    found = conn.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                         "WHERE application_name = %s", (application_name,)).fetchone()
    return int(found[0])


def test_a_job_after_its_executors_connection_was_ended_runs_its_first_attempt(conn, jobs_db) -> None:
    logged: list[dict[str, Any]] = []
    config = WorkerConfig(dsn=jobs_db, max_concurrency=1, lease_duration_s=4.0, poll_interval_s=0.05,
                          reconcile_interval_s=0.5, listen=False, drain_timeout_s=1.0,
                          application_name="t-idle-ended")

    def work(ctx: Any) -> str:
        ctx.put_result("step", {"n": ctx.job.payload["n"]})  # a fenced write on the job's connection
        return "done"

    pool = WorkerPool(config, {"work": work}, log=recording_logger(logged))
    pool.start()
    try:
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="work", payload={"n": 1}, max_attempts=1)])
        wait_until(lambda: [r[0] for r in _jobs(jobs_db)] == ["succeeded"], timeout_s=20, message="first job")
        assert _end_sessions(conn, "t-idle-ended") >= 2  # the dispatcher's, the executor's (and the heartbeat's)
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="work", payload={"n": 2}, max_attempts=1)])
        wait_until(lambda: _jobs(jobs_db)[1][0] in ("succeeded", "failed"), timeout_s=30,
                   message=lambda: f"the second job ended: {_jobs(jobs_db)}")
    finally:
        pool.stop()
    assert _jobs(jobs_db) == [("succeeded", 1, None)] * 2, _jobs(jobs_db)
    assert rows(jobs_db, "SELECT value FROM job_results ORDER BY job_id") == [({"n": 1},), ({"n": 2},)]
    assert not [e for e in logged if e["event"] in ("lease_lost", "job_attempt_failed")], \
        [e for e in logged if e["event"] in ("lease_lost", "job_attempt_failed")]


def test_the_idle_check_never_reads_a_connection_another_thread_is_using(jobs_db) -> None:
    # The heartbeat's keep-alive of a fenced transaction sends its statement on the handler's
    # connection, from another thread.  The check read the socket between that thread's send
    # and its wait: the answer went into libpq's buffer, psycopg waited for the socket to turn
    # readable for ever, the lock held, and the executor's next write waited behind it, the
    # job's lease renewed all along (the kills bench, once in about a hundred runs).  Here the
    # other thread holds the connection's lock while something waits on the socket (a
    # notification: data while idle).
    with psycopg.connect(jobs_db, autocommit=True) as conn, \
            psycopg.connect(jobs_db, autocommit=True) as other:
        conn.execute("LISTEN idle_check")
        other.execute("NOTIFY idle_check")
        wait_until(lambda: _readable(conn.pgconn.socket), timeout_s=10, message="the notification never came")
        with conn.lock:  # another thread's statement under way
            assert ended(conn) is False
            assert _readable(conn.pgconn.socket), "the check read a connection another thread was using"
        assert ended(conn) is False  # idle and free: read, a notification and not the end
        assert not _readable(conn.pgconn.socket)
