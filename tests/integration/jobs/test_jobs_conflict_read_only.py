"""A handler whose statement met a conflict (SQLSTATE class 40: a serialization failure, a
deadlock) or a read-only database (25006: a failover in progress, a pooler routing to a
standby), on a real PostgreSQL with a real worker pool.

Each counted an attempt: retried until max_attempts, then dead-lettered ``attempts_exhausted``
for what was not the job's doing (a failover's read-only window, a contended row).  Now the job
is given back, fenced, the attempt not counted (``job_given_back`` with its cause,
``outbox_jobs_given_back_total{cause="conflict"|"read_only"}``), within the budget of
interruptions the broken connection uses (``max_interruptions``, migrations 0017 and 0018): a
job that meets a conflict every time still ends, its dead letter saying how many of each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from consumer_sdk.jobs import Backoff, JobsMetrics, NewJob, WorkerConfig, WorkerPool, enqueue
from consumer_sdk.jobs import queue as jobq
from consumer_sdk.jobs.context import JobContext
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import claim_next, recording_logger, rows

QUICK = Backoff(initial_s=0.05, max_s=0.05)
EFFECT = "INSERT INTO effects (job_id, token, step) VALUES (%s, %s, %s)"
JOB_ROW = "SELECT status, attempts, interruptions FROM jobs"
#: Among the interruptions, the conflicts and the read-only ones (migration 0018).
CAUSES = "SELECT conflict_interruptions, read_only_interruptions FROM jobs"


def _raise(sqlstate: str) -> str:
    """A real server error of ``sqlstate`` (PL/pgSQL's RAISE: the server aborts the transaction)."""
    return f"DO $$ BEGIN RAISE EXCEPTION 'raised as {sqlstate}' USING ERRCODE = '{sqlstate}'; END $$"


class Pool:
    """A running pool's log, metrics and the backend each run of the handler had."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.metrics = JobsMetrics()
        self.backends: list[int] = []

    def named(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]

    def counted(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)


@pytest.fixture
def run_pool(jobs_db: str) -> Iterator[Callable[..., Pool]]:
    started: list[WorkerPool] = []

    def run(handler: Callable[[JobContext], Any], *, max_attempts: int, max_interruptions: int = 10) -> Pool:
        seen = Pool()

        def work(ctx: JobContext) -> Any:
            seen.backends.append(ctx.conn.info.backend_pid)
            return handler(ctx)

        # Polled rarely: a job given back is claimed when due because the give-back wakes the pool.
        config = WorkerConfig(dsn=jobs_db, max_concurrency=1, poll_interval_s=5.0, listen=False,
                              drain_timeout_s=1.0, backoff=QUICK, max_interruptions=max_interruptions)
        pool = WorkerPool(config, {"work": work}, metrics=seen.metrics, log=recording_logger(seen.events))
        started.append(pool)
        with psycopg.connect(jobs_db, autocommit=True) as conn:
            enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="work", payload={}, max_attempts=max_attempts)])
        pool.start()
        wait_until(lambda: rows(jobs_db, "SELECT status FROM jobs")[0][0] in ("succeeded", "failed"), timeout_s=15,
                   message=lambda: f"the job never ended: {[e['event'] for e in seen.events]}")
        return seen

    yield run
    for pool in started:
        pool.stop()


@pytest.mark.parametrize("way", ["raised", "caught_in_fenced_transaction"])
def test_a_job_meeting_conflicts_more_often_than_its_attempts_succeeds_uncounted(
        run_pool: Callable[..., Pool], jobs_db: str, way: str) -> None:
    """A 40001 four times on a job of max_attempts 2: dead-lettered on its 2nd attempt before."""
    runs: list[int] = []

    def work(ctx: JobContext) -> str:
        runs.append(ctx.job.attempts)
        with ctx.fenced_transaction() as tx:
            tx.execute(EFFECT, (ctx.job.id, ctx.job.token, len(runs)))
            if len(runs) <= 4:
                if way == "raised":
                    tx.execute(_raise("40001"))
                try:  # fenced_transaction() raises TransactionConflict at its end
                    tx.execute(_raise("40P01"))
                except psycopg.Error:
                    pass
        return "done"

    pool = run_pool(work, max_attempts=2)
    assert rows(jobs_db, JOB_ROW) == [("succeeded", 1, 4)]
    assert rows(jobs_db, CAUSES) == [(4, 0)]
    assert runs == [1] * 5
    assert rows(jobs_db, "SELECT step FROM effects") == [(5,)]  # the four conflicts' rolled back
    assert rows(jobs_db, "SELECT count(*) FROM job_dead_letters") == [(0,)]
    given = pool.named("job_given_back")
    assert [g["cause"] for g in given] == ["conflict"] * 4 and given[-1]["interruptions"] == 4, given
    assert "conflict" in given[0]["hint"] and "not counted" in given[0]["hint"]
    assert all(0 <= g["due_in_s"] <= 0.05 for g in given), given  # short: at most the first back-off
    assert len(set(pool.backends)) == 1  # the handler's connection was alive: never replaced
    assert not pool.named("job_attempt_failed") and not pool.named("job_write_read_only")
    assert pool.counted("outbox_jobs_given_back_total", queue="bulk", cause="conflict") == 4.0
    assert pool.counted("outbox_jobs_retries_total", queue="bulk") is None


def test_a_job_meeting_a_conflict_every_time_ends_once_the_budget_is_spent(
        run_pool: Callable[..., Pool], jobs_db: str) -> None:
    def work(ctx: JobContext) -> None:
        ctx.conn.execute(_raise("40001"))

    pool = run_pool(work, max_attempts=2, max_interruptions=3)
    assert rows(jobs_db, JOB_ROW) == [("failed", 2, 3)]
    assert rows(jobs_db, CAUSES) == [(3, 0)]
    [(reason, error, error_type)] = rows(jobs_db, "SELECT reason, error, error_type FROM job_dead_letters")
    assert (reason, error_type) == ("attempts_exhausted", "SerializationFailure")
    assert error.startswith("SerializationFailure: raised as 40001"), error
    assert error.endswith(" (through no fault of its own again: a conflict (a deadlock or a serialization "
                          "failure); the pool's max_interruptions=3 were spent (a conflict (a deadlock or a "
                          "serialization failure) 3 times), so each such attempt counts)"), error
    assert len(pool.named("job_given_back")) == 3 and len(pool.backends) == 5
    assert pool.counted("outbox_jobs_given_back_total", queue="bulk", cause="conflict") == 3.0
    assert pool.counted("outbox_jobs_given_back_total", queue="bulk", cause="interruptions_exhausted") == 2.0
    assert [e["cause"] for e in pool.named("job_interruptions_exhausted")] == ["conflict"] * 2
    assert pool.counted("outbox_jobs_dead_lettered_total", queue="bulk", reason="attempts_exhausted") == 1.0


@pytest.mark.parametrize("way", ["session", "transaction"])
def test_a_write_the_database_refused_as_read_only_is_given_back_uncounted(
        run_pool: Callable[..., Pool], jobs_db: str, way: str) -> None:
    """25006 on the job's only attempt: dead-lettered ``attempts_exhausted`` before.  A session
    left read-only (as on a standby) is not written on again: the give-back goes on a new one."""
    runs: list[int] = []

    def work(ctx: JobContext) -> str:
        runs.append(ctx.job.attempts)
        if len(runs) == 1 and way == "session":
            ctx.conn.execute("SET default_transaction_read_only = on")
        with ctx.fenced_transaction() as tx:
            if len(runs) == 1 and way == "transaction":
                tx.execute("SET TRANSACTION READ ONLY")
            tx.execute(EFFECT, (ctx.job.id, ctx.job.token, len(runs)))
        return "done"

    pool = run_pool(work, max_attempts=1)
    assert rows(jobs_db, JOB_ROW) == [("succeeded", 1, 1)]
    assert rows(jobs_db, CAUSES) == [(0, 1)]
    assert runs == [1, 1] and rows(jobs_db, "SELECT step FROM effects") == [(2,)]
    [given] = pool.named("job_given_back")
    assert given["cause"] == "read_only" and "read-only" in given["hint"] and "not counted" in given["hint"]
    assert given["error"].startswith(("ReadOnlySqlTransaction: ", "DatabaseReadOnly: ")), given
    assert pool.counted("outbox_jobs_given_back_total", queue="bulk", cause="read_only") == 1.0
    # Only a session that stays read-only is left for a new connection.
    assert len(pool.named("job_write_read_only")) == (1 if way == "session" else 0)
    assert (pool.backends[0] == pool.backends[1]) == (way == "transaction")


def test_a_read_only_give_back_waits_longer_each_time(conn: Any) -> None:
    """The retry back-off, growing with the job's read-only interruptions (a failover's window
    outlasts a second); a conflict's pause does not grow."""
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="k", payload={}, max_attempts=3)])
    said = {"error": "ReadOnlySqlTransaction: read-only", "error_type": "ReadOnlySqlTransaction",
            "delay_s": 10.0, "growth": 2.0, "max_delay_s": 30.0, "max_interruptions": 10}
    due = []
    for cause in ("read_only", "read_only", "read_only", "conflict"):
        (job,) = claim_next(conn, "A", now=None, queues=("bulk",), lease_s=30.0)
        found = jobq.give_back(conn, job.lease, cause=cause, **said)
        assert found is not None and found.given
        due.append(round(found.due_in_s))
        conn.execute("UPDATE jobs SET available_at = now()")
    assert due == [10, 20, 30, 10]
    assert found.interruptions == 4 and (found.conflicts, found.read_only) == (1, 3)


def test_a_failure_written_on_a_session_that_went_read_only_goes_on_a_new_connection(
        run_pool: Callable[..., Pool], jobs_db: str) -> None:
    """The handler's own failure, its session read-only by then (a pooler moved it to a standby):
    its retry's write met 25006 on that session, and the job was left to its lease
    (job_write_failed: it waited out the lease, then its attempt was counted by the reaper)."""
    runs: list[int] = []

    def work(ctx: JobContext) -> str:
        runs.append(ctx.job.attempts)
        if len(runs) == 1:
            ctx.conn.execute("SET default_transaction_read_only = on")
            raise ValueError("the handler's own failure")
        return "done"

    pool = run_pool(work, max_attempts=2)
    assert rows(jobs_db, "SELECT status, attempts FROM jobs") == [("succeeded", 2)]
    assert runs == [1, 2]
    assert pool.named("job_write_read_only") and not pool.named("job_write_failed"), pool.events
