"""The worker pool against a real PostgreSQL: outcomes, retries, dead letters (test 4 of the
issue), cancellation by the owner, lost leases, and a clean stop."""

from __future__ import annotations

import io
import json
import threading
from typing import Any

from consumer_sdk.jobs import (
    Backoff,
    JobContext,
    JobsMetrics,
    NewJob,
    PermanentJobError,
    TransientJobError,
    accept,
    cancel_run,
    enqueue,
    run_status,
)
from consumer_sdk.jobs import cli as jobs_cli
from consumer_sdk.jobs.admin import dead_letters, requeue_dead
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import job_status, rows, scalar

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
FAST_RETRY = Backoff(initial_s=0.05, max_s=0.2)


def _accept(conn: Any, key: str, kind: str, body: Any = None, **kw: Any) -> Any:
    return accept(conn, owner_id="tenant-1", request_key=key, kind=kind, body=body or {}, **kw)


def _terminal(conn: Any, run: Any, timeout_s: float = 20) -> Any:
    return wait_until(lambda: (s := run_status(conn, run.run_id)).terminal and s, timeout_s=timeout_s,
                      message=lambda: f"run not terminal: {run_status(conn, run.run_id)}")


def test_a_job_runs_and_succeeds_with_its_result_and_metrics(conn, pools):
    seen: list[JobContext] = []

    def report(ctx: JobContext) -> Any:
        seen.append(ctx)
        ctx.put_result("part-1", {"rows": 3})
        return {"total": ctx.payload["n"] * 2}

    metrics = JobsMetrics()
    pools({"report": report}, metrics=metrics)
    run = _accept(conn, "k1", "report", {"n": 21}, traceparent=TRACEPARENT)
    state = _terminal(conn, run)
    assert (state.status, state.result, state.attempts) == ("succeeded", {"total": 42}, 1)
    ctx = seen[0]
    assert ctx.job.traceparent == TRACEPARENT
    assert ctx.idempotency_key == f"job-{run.job_id}-attempt-1"
    assert ctx.effect_key("mail") == f"job-{run.job_id}-mail"
    assert rows(conn.info.dsn, "SELECT key, value FROM job_results") == [("part-1", {"rows": 3})]
    sample = metrics.registry.get_sample_value
    wait_until(lambda: sample("outbox_jobs_finished_total", {"queue": "interactive", "status": "succeeded"}),
               timeout_s=5)
    assert sample("outbox_jobs_claimed_total", {"queue": "interactive"}) == 1
    assert sample("outbox_jobs_accept_to_terminal_seconds_count",
                  {"queue": "interactive", "status": "succeeded"}) == 1
    assert sample("outbox_jobs_attempts_sum", {"queue": "interactive"}) == 1
    assert sample("outbox_jobs_workers_capacity") == 2


def test_the_busy_gauge_is_the_pools_running_count_when_scraped(conn, pools):
    release = threading.Event()

    def slow(ctx: JobContext) -> Any:
        release.wait(10)
        return None

    metrics = JobsMetrics()
    pools({"slow": slow}, metrics=metrics)
    busy = lambda: metrics.registry.get_sample_value("outbox_jobs_workers_busy",  # noqa: E731
                                                     {"queue": "interactive"})
    assert busy() == 0
    run = _accept(conn, "k1", "slow")
    wait_until(lambda: busy() == 1, timeout_s=10, message=lambda: f"busy: {busy()}")
    release.set()
    assert _terminal(conn, run).status == "succeeded"
    wait_until(lambda: busy() == 0, timeout_s=5, message=lambda: f"busy: {busy()}")


def test_transient_errors_are_retried_with_backoff_until_success(conn, pools):
    calls: list[int] = []

    def flaky(ctx: JobContext) -> Any:
        calls.append(ctx.job.attempts)
        if ctx.job.attempts < 3:
            raise TransientJobError("upstream timed out")
        return "ok"

    metrics = JobsMetrics()
    pools({"flaky": flaky}, backoff=FAST_RETRY, metrics=metrics, poll_interval_s=5)
    run = _accept(conn, "k1", "flaky")
    state = _terminal(conn, run)
    assert (state.status, state.attempts, calls) == ("succeeded", 3, [1, 2, 3])
    assert state.last_error == "TransientJobError: upstream timed out"
    assert metrics.registry.get_sample_value("outbox_jobs_retries_total", {"queue": "interactive"}) == 2


def test_a_permanent_failure_is_dead_lettered_once_with_reason_and_trace(conn, pools):
    """Test 4: terminal 'failed', one dead letter with a readable reason and the trace id,
    readable with the command."""

    def broken(ctx: JobContext) -> Any:
        raise PermanentJobError("credential revoked for source 'registry'")

    metrics = JobsMetrics()
    pools({"broken": broken}, metrics=metrics)
    run = _accept(conn, "k1", "broken", max_attempts=5, traceparent=TRACEPARENT)
    state = _terminal(conn, run)
    assert (state.status, state.attempts, state.dead_reason) == ("failed", 1, "permanent_error")
    (record,) = dead_letters(conn)
    assert (record.job_id, record.run_id, record.reason, record.attempts) == (
        run.job_id, run.run_id, "permanent_error", 1)
    assert record.error == "PermanentJobError: credential revoked for source 'registry'"
    assert record.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert metrics.registry.get_sample_value("outbox_jobs_dead_lettered_total",
                                             {"queue": "interactive", "reason": "permanent_error"}) == 1
    out = io.StringIO()
    assert jobs_cli.main(["dead-letters", "list", "--dsn", conn.info.dsn], out=out) == 0
    text = out.getvalue()
    assert "reason:   permanent_error after 1 attempt(s)" in text
    assert "credential revoked" in text and "4bf92f3577b34da6a3ce929d0e0e4736" in text
    out = io.StringIO()
    assert jobs_cli.main(["dead-letters", "show", str(run.job_id), "--json", "--dsn", conn.info.dsn],
                         out=out) == 0
    assert json.loads(out.getvalue())["reason"] == "permanent_error"


def test_attempts_run_out_then_the_job_is_dead_lettered(conn, pools):
    def always(ctx: JobContext) -> Any:
        raise ConnectionError("source unreachable")

    pools({"always": always}, backoff=FAST_RETRY, poll_interval_s=5)
    run = _accept(conn, "k1", "always", max_attempts=3)
    state = _terminal(conn, run)
    assert (state.status, state.attempts, state.dead_reason) == ("failed", 3, "attempts_exhausted")
    (record,) = dead_letters(conn)
    assert record.error == "ConnectionError: source unreachable" and record.attempts == 3
    # An operator retries it: queued again with a fresh budget, the record is gone.
    assert requeue_dead(conn, run.job_id)
    wait_until(lambda: dead_letters(conn) and job_status(conn.info.dsn, run.job_id) == "failed",
               timeout_s=20)
    assert scalar(conn.info.dsn, "SELECT count(*) FROM job_audit WHERE status = 'failed'") == 2


def test_an_unknown_kind_and_an_unstorable_result_fail_permanently(conn, pools):
    pools({"bad_result": lambda ctx: {1, 2}})
    unknown = _terminal(conn, _accept(conn, "k1", "nobody-handles-this"))
    assert unknown.dead_reason == "permanent_error"
    assert "no handler is registered for kind 'nobody-handles-this'" in unknown.last_error
    bad = _terminal(conn, _accept(conn, "k2", "bad_result"))
    assert bad.dead_reason == "permanent_error" and "JSON" in bad.last_error


def test_the_owner_cancels_a_running_run_and_the_worker_stops_writing(conn, pools):
    started, stopped = threading.Event(), threading.Event()

    def slow(ctx: JobContext) -> Any:
        started.set()
        try:
            while True:
                ctx.sleep(0.05)
        finally:
            stopped.set()

    metrics = JobsMetrics()
    pools({"slow": slow}, lease_duration_s=3.0, heartbeat_interval_s=0.2, metrics=metrics)
    run = _accept(conn, "k1", "slow")
    assert started.wait(10)
    state = cancel_run(conn, owner_id="tenant-1", run_id=run.run_id)
    assert state.status == "cancelled"
    assert stopped.wait(5), "the handler was not cancelled"
    wait_until(lambda: metrics.registry.get_sample_value(
        "outbox_jobs_leases_lost_total", {"queue": "interactive", "reason": "cancelled"}), timeout_s=5)
    assert rows(conn.info.dsn, "SELECT status FROM job_audit ORDER BY at") == [("running",), ("cancelled",)]
    # Cancelling again, or a terminal run, changes nothing.
    assert cancel_run(conn, owner_id="tenant-1", run_id=run.run_id).status == "cancelled"


def test_a_queued_run_is_cancelled_before_any_worker_sees_it(conn):
    run = _accept(conn, "k1", "never")
    assert cancel_run(conn, owner_id="tenant-1", run_id=run.run_id).status == "cancelled"
    assert run_status(conn, run.run_id, owner_id="someone-else") is None


def test_stop_gives_running_jobs_back_without_counting_the_attempt(conn, pools, jobs_db):
    started = threading.Event()

    def endless(ctx: JobContext) -> Any:
        started.set()
        while True:
            ctx.sleep(0.05)

    pool = pools({"endless": endless})
    run = _accept(conn, "k1", "endless")
    assert started.wait(10)
    pool.stop(drain_timeout_s=0.2)
    state = run_status(conn, run.run_id)
    assert (state.status, state.attempts) == ("queued", 0)
    assert pool.outcomes["released"] == 1


def test_stop_gives_lined_up_jobs_back_without_running_them(conn, pools, jobs_db):
    """Short jobs are claimed ahead (consumer_sdk/jobs/line.py): on stop, the jobs waiting in
    the pool's line are released without their handler ever running, the attempt not counted."""
    ran: list[str] = []

    def fast(ctx: JobContext) -> Any:
        ran.append("fast")

    def slow(ctx: JobContext) -> Any:
        ran.append("slow")
        while True:
            ctx.sleep(0.05)

    enqueue(conn, [NewJob(owner_id="o", queue="interactive", kind="fast", payload={}) for _ in range(40)])
    enqueue(conn, [NewJob(owner_id="o", queue="interactive", kind="slow", payload={}) for _ in range(10)])
    pool = pools({"fast": fast, "slow": slow}, max_concurrency=2, poll_interval_s=0.2)
    wait_until(lambda: ran.count("slow") == 2 and scalar(
        jobs_db, "SELECT count(*) FROM jobs WHERE status = 'running'") > 2, timeout_s=20,
        message=lambda: f"no job lined up: ran {len(ran)}")
    pool.stop(drain_timeout_s=0.3)
    assert ran.count("slow") == 2 and ran.count("fast") == 40
    assert rows(jobs_db, "SELECT status, attempts, count(*) FROM jobs WHERE kind = 'slow' "
                         "GROUP BY status, attempts") == [("queued", 0, 10)]
    assert pool.outcomes["released"] >= 3 and pool.outcomes["succeeded"] == 40


def test_a_pooler_that_lost_psycopgs_prepared_statement_gives_the_job_back_uncounted(conn, pools):
    """Behind a transaction pooler without prepared-statement support, a statement psycopg
    prepared on one server is missing on the next, and the handler running it raised:
    counted as a failed attempt, retried, dead-lettered once the attempts ran out.  Now the
    job is given back with its attempt not counted, and psycopg's automatic preparing is off
    for the connection.  The error is raised here as psycopg raises it there;
    tests/integration/test_pgbouncer.py meets the real one through PgBouncer (the inbox)."""
    import psycopg

    seen: list[tuple[int, Any]] = []

    def work(ctx: JobContext) -> Any:
        seen.append((ctx.job.attempts, ctx.conn.prepare_threshold))
        if len(seen) == 1:
            raise psycopg.errors.InvalidSqlStatementName('prepared statement "_pg3_3" does not exist')
        return "ok"

    pools({"work": work}, backoff=FAST_RETRY, poll_interval_s=0.2, max_concurrency=1)
    run = _accept(conn, "k1", "work")
    state = _terminal(conn, run)
    assert (state.status, state.attempts, state.last_error) == ("succeeded", 1, None)
    assert seen == [(1, 5), (1, None)]  # the same attempt number again; preparing off the second time
