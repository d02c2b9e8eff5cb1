"""A handler whose database connection broke under it (its backend ended by
``pg_terminate_backend``, as a failover, a pooler or an administrator ends it), on a real
PostgreSQL.

Its failure counted an attempt: retried with back-off or, on the job's last attempt,
dead-lettered ``attempts_exhausted`` for something that was not the job's doing.  Now the job
is given back on a new connection, fenced, the attempt not counted (``job_given_back``,
``outbox_jobs_given_back_total{cause="connection_broke"}``), and its interruptions counted
(migration 0017); past the pool's ``max_interruptions`` the attempt counts again and the
dead letter says how many times the connection broke.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from consumer_sdk import _pg
from consumer_sdk.jobs import Backoff, JobsMetrics, NewJob, WorkerConfig, WorkerPool, admin, enqueue
from consumer_sdk.jobs import queue as jobq
from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.executor import Executor
from outbox_embedded.procs import free_port
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import claim_next, recording_logger, rows

QUICK = Backoff(initial_s=0.05, max_s=0.05)


EFFECT = "INSERT INTO effects (job_id, token, step) VALUES (%s, %s, 1)"


@pytest.mark.parametrize("way", ["execute", "fenced_transaction", "fenced_execute"])
def test_a_job_whose_backend_was_terminated_mid_handler_succeeds_its_only_attempt_later(
        conn, jobs_db, way: str) -> None:
    """Through a fenced write, the broken connection raised LeaseLost (authority could not be
    proven): nothing was written, the job waited out its lease and the reaper dead-lettered it
    (``lease_expired``) on its only attempt; the fenced give-back finds the lease held."""
    events: list[dict[str, Any]] = []
    metrics = JobsMetrics()
    config = WorkerConfig(dsn=jobs_db, max_concurrency=1, lease_duration_s=4.0, poll_interval_s=0.05,
                          reconcile_interval_s=5.0, listen=False, drain_timeout_s=1.0, backoff=QUICK,
                          application_name="t-conn-broke")
    backends: list[int] = []
    running, terminated = threading.Event(), threading.Event()

    def work(ctx: Any) -> str:
        backends.append(ctx.conn.info.backend_pid)
        if len(backends) == 1:  # the first run: its backend is ended under it
            running.set()
            assert terminated.wait(20)
        if way == "execute":
            ctx.conn.execute("SELECT 1")
        elif way == "fenced_transaction":
            with ctx.fenced_transaction() as tx:
                tx.execute(EFFECT, (ctx.job.id, ctx.job.token))
        else:
            ctx.fenced_execute(EFFECT, (ctx.job.id, ctx.job.token))
        return "done"

    pool = WorkerPool(config, {"work": work}, metrics=metrics, log=recording_logger(events))
    pool.start()
    try:
        (job_id,) = enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="work", payload={}, max_attempts=1)])
        assert running.wait(20), "the handler never ran"
        # Waits (5 s at most) until the backend is gone, so the handler's next statement meets it ended.
        assert conn.execute("SELECT pg_terminate_backend(%s, 5000)", (backends[0],)).fetchone() == (True,)
        terminated.set()
        wait_until(lambda: rows(jobs_db, "SELECT status FROM jobs")[0][0] in ("succeeded", "failed"), timeout_s=20,
                   message=lambda: f"the job ended: {[e['event'] for e in events]}")
    finally:
        terminated.set()
        pool.stop()
    assert rows(jobs_db, "SELECT status, attempts, interruptions FROM jobs") == [("succeeded", 1, 1)]
    assert rows(jobs_db, "SELECT count(*) FROM job_dead_letters") == [(0,)]
    if way != "execute":  # written once, by the run that held a live connection
        assert rows(jobs_db, "SELECT count(*) FROM effects") == [(1,)]
    assert len(backends) == 2 and backends[1] != backends[0]  # run again, on a new connection
    [given] = [e for e in events if e["event"] == "job_given_back"]
    assert given["job_id"] == job_id and given["interruptions"] == 1 and given["max_interruptions"] == 10
    assert "not counted" in given["hint"] and "connection broke" in given["hint"]
    # Given back on a new connection at once: never written on the dead one and sent again.
    assert not [e for e in events if e["event"] in ("job_failed", "job_attempt_failed", "lease_lost",
                                                    "job_write_unconfirmed", "job_write_failed")], events
    assert metrics.registry.get_sample_value(
        "outbox_jobs_given_back_total", {"queue": "bulk", "cause": "connection_broke"}) == 1.0
    assert metrics.registry.get_sample_value("outbox_jobs_retries_total", {"queue": "bulk"}) is None


def _run_once_ending_its_backend(conn: Any, jobs_db: str, *, interruptions: int, max_interruptions: int,
                                 metrics: JobsMetrics, events: list[dict[str, Any]],
                                 reconnect: Callable[[], Any] | None = None, deadline_s: float = 20) -> str:
    """One attempt of a fresh job (max_attempts 1, ``interruptions`` already counted) whose
    handler ends its own backend, run by an executor allowing ``max_interruptions``."""
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="crash", payload={}, max_attempts=1)])
    conn.execute("UPDATE jobs SET interruptions = %s", (interruptions,))
    (job,) = claim_next(conn, "A", now=None, queues=("bulk",), lease_s=30.0)
    ctx = JobContext(job, deadline=time.monotonic() + deadline_s)
    ctx.bind(psycopg.connect(jobs_db, autocommit=True),
             reconnect=reconnect or (lambda: psycopg.connect(jobs_db, autocommit=True)))

    def crash(ctx: Any) -> None:
        ctx.conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")

    executor = Executor(handlers={"crash": crash}, backoff=QUICK, metrics=metrics, log=recording_logger(events),
                        events_topic=None, db_now=lambda: None, max_interruptions=max_interruptions)
    try:
        return executor.run(ctx)
    finally:
        ctx.conn.close()


def test_a_job_under_the_bound_is_given_back_and_its_interruption_counted(conn, jobs_db) -> None:
    events: list[dict[str, Any]] = []
    metrics = JobsMetrics()
    outcome = _run_once_ending_its_backend(conn, jobs_db, interruptions=1, max_interruptions=2, metrics=metrics,
                                           events=events)
    assert outcome == "given_back"
    [(status, attempts, interruptions, lease_until, error, error_type)] = rows(
        jobs_db, "SELECT status, attempts, interruptions, lease_until, last_error, last_error_type FROM jobs")
    assert (status, attempts, interruptions, lease_until) == ("queued", 0, 2, None)
    assert error_type == "AdminShutdown" and "terminating connection" in error, error


@pytest.mark.parametrize("already", [2, 5])
def test_past_the_bound_the_attempt_counts_and_the_dead_letter_says_why(conn, jobs_db, already: int) -> None:
    events: list[dict[str, Any]] = []
    metrics = JobsMetrics()
    outcome = _run_once_ending_its_backend(conn, jobs_db, interruptions=already, max_interruptions=2,
                                           metrics=metrics, events=events)
    assert outcome == "failed"
    assert rows(jobs_db, "SELECT status, attempts, interruptions FROM jobs") == [("failed", 1, already)]
    [(reason, error, error_type)] = rows(jobs_db, "SELECT reason, error, error_type FROM job_dead_letters")
    assert (reason, error_type) == ("attempts_exhausted", "AdminShutdown")
    assert error.startswith("AdminShutdown: terminating connection"), error
    assert error.endswith(f" (the database connection broke under this job's attempts {already + 1} times: "
                          "past the pool's max_interruptions=2, each such attempt counts)"), error
    assert "job_given_back" not in [e["event"] for e in events]
    assert metrics.registry.get_sample_value(
        "outbox_jobs_given_back_total", {"queue": "bulk", "cause": "connection_broke"}) is None
    assert metrics.registry.get_sample_value(
        "outbox_jobs_dead_lettered_total", {"queue": "bulk", "reason": "attempts_exhausted"}) == 1.0
    # An operator's requeue gives the job a fresh budget of interruptions with its attempts.
    assert admin.requeue_dead(conn, rows(jobs_db, "SELECT id FROM jobs")[0][0])
    assert rows(jobs_db, "SELECT status, attempts, interruptions FROM jobs") == [("queued", 0, 0)]


@pytest.mark.parametrize("database_back", [True, False])
def test_a_give_back_that_cannot_reconnect_says_nothing_was_written(conn, jobs_db, database_back: bool) -> None:
    """The reconnect before the give-back fails (nothing listens where the new connection goes:
    the database still away).  Logged ``job_write_unconfirmed`` before (a reply lost, while
    nothing had been sent): now ``job_write_not_sent``, once, and the give-back is written when a
    new connection can be made; never, the job is left to its lease (``job_write_failed``)."""
    events: list[dict[str, Any]] = []
    away = psycopg.conninfo.make_conninfo(jobs_db, host="127.0.0.1", port=free_port())
    tried: list[str] = []

    def reconnect() -> Any:  # the pool's own factory: refused while away, then (database_back) the database
        dsn = jobs_db if database_back and tried else away
        tried.append(dsn)
        return _pg.connect(dsn, application_name="t-conn-broke", connect_timeout_s=2)

    outcome = _run_once_ending_its_backend(conn, jobs_db, interruptions=0, max_interruptions=2,
                                           metrics=JobsMetrics(), events=events, reconnect=reconnect,
                                           deadline_s=20 if database_back else 1)
    names = [e["event"] for e in events]
    assert "job_write_unconfirmed" not in names, names
    [not_sent] = [e for e in events if e["event"] == "job_write_not_sent"]
    assert "nothing of its outcome was written yet" in not_sent["detail"], not_sent
    assert "waits out its lease" in not_sent["detail"], not_sent
    if database_back:
        assert (outcome, tried[0]) == ("given_back", away) and len(tried) == 2
        assert rows(jobs_db, "SELECT status, attempts, interruptions FROM jobs") == [("queued", 0, 1)]
        assert names.index("job_write_not_sent") < names.index("job_given_back")
    else:
        assert outcome == "lost" and "job_write_failed" in names, names
        assert rows(jobs_db, "SELECT status, attempts, interruptions FROM jobs") == [("running", 1, 0)]


def test_a_give_back_whose_reply_was_lost_is_found_by_its_lease(conn, jobs_db) -> None:
    """The executor sends a give-back again on a new connection when its reply was lost: sent
    again it matches no row (the job is no longer running), and the question finds it written."""
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="k", payload={}, max_attempts=3)])
    (job,) = claim_next(conn, "A", now=None, queues=("bulk",), lease_s=30.0)
    said = {"error": "AdminShutdown: terminating connection", "error_type": "AdminShutdown"}
    assert jobq.found_given_back(conn, job.lease, attempts=job.attempts, **said) is None  # not yet
    give_back = {**said, "cause": "connection_broke", "delay_s": 0.0, "max_interruptions": 10}
    given = jobq.give_back(conn, job.lease, **give_back)
    assert given is not None and (given.interruptions, given.given) == (1, True)
    assert jobq.give_back(conn, job.lease, **give_back) is None  # fenced: once
    found = jobq.found_given_back(conn, job.lease, attempts=job.attempts, **said)
    assert found is not None and (found.interruptions, found.given) == (1, True)
    assert jobq.found_given_back(conn, job.lease, attempts=job.attempts, error="another",
                                 error_type="AdminShutdown") is None
    assert rows(jobs_db, "SELECT status, attempts, interruptions FROM jobs") == [("queued", 0, 1)]


def test_a_statement_the_server_cancelled_still_counts_its_attempt(conn, jobs_db) -> None:
    """57014 (statement_timeout) ends the statement, not the session: the job's own failure."""
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="slow", payload={}, max_attempts=1)])
    (job,) = claim_next(conn, "A", now=None, queues=("bulk",), lease_s=30.0)
    ctx = JobContext(job, deadline=time.monotonic() + 20)
    ctx.bind(psycopg.connect(jobs_db, autocommit=True), reconnect=lambda: psycopg.connect(jobs_db, autocommit=True))

    def slow(ctx: Any) -> None:
        ctx.conn.execute("SET statement_timeout = '50ms'")
        ctx.conn.execute("SELECT pg_sleep(5)")

    executor = Executor(handlers={"slow": slow}, backoff=QUICK, metrics=JobsMetrics(), log=recording_logger([]),
                        events_topic=None, db_now=lambda: None)
    try:
        assert executor.run(ctx) == "failed"
    finally:
        ctx.conn.close()
    assert rows(jobs_db, "SELECT status, attempts, interruptions FROM jobs") == [("failed", 1, 0)]
    assert rows(jobs_db, "SELECT reason, error_type FROM job_dead_letters") == [("attempts_exhausted", "QueryCanceled")]
