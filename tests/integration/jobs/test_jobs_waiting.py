"""Test 7 of the issue: waiting and resume, with the activation lost (the reconciler resumes
the job), duplicated (one advance), and arriving before the job parked (it still resumes)."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from consumer_sdk.jobs import (
    JobContext,
    JobsMetrics,
    Reconciler,
    WaitFor,
    accept,
    activate,
    resume_job,
    waits,
)
from consumer_sdk.jobs import queue as jobq
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import at, claim_next, job_status, rows, scalar


def approval(ctx: JobContext) -> Any:
    """Waits for "approval:<id>" once, then finishes with what the activation said."""
    key = f"approval:{ctx.payload['id']}"
    if ctx.job.wait_key is None:
        return WaitFor(key, "awaiting approval", timeout_s=ctx.payload.get("timeout_s"))
    if ctx.activation is None:
        return {"approved": False, "timed_out": True}
    return {"approved": ctx.activation["ok"]}


def _start(conn: Any, n: int, **body: Any) -> Any:
    return accept(conn, owner_id="tenant-1", request_key=f"r{n}", kind="approval", body={"id": n, **body})


def _transitions(dsn: str, job_id: int) -> list[str]:
    return [r[0] for r in rows(dsn, "SELECT status FROM job_audit WHERE job_id = %s ORDER BY at", (job_id,))]


def test_a_parked_job_frees_the_worker_and_an_activation_resumes_it(conn, pools, jobs_db):
    pools({"approval": approval}, max_concurrency=1)
    run = _start(conn, 1)
    wait_until(lambda: job_status(jobs_db, run.job_id) == "waiting", timeout_s=10)
    second = _start(conn, 2)  # the only slot is free again: the second run parks too
    wait_until(lambda: job_status(jobs_db, second.job_id) == "waiting", timeout_s=10)
    assert rows(jobs_db, "SELECT wait_cause FROM jobs WHERE id = %s", (run.job_id,)) == [("awaiting approval",)]

    result = activate(conn, "approval:1", {"ok": True})
    assert result.recorded and result.resumed == (run.job_id,)
    wait_until(lambda: job_status(jobs_db, run.job_id) == "succeeded", timeout_s=10)
    assert scalar(jobs_db, "SELECT result FROM jobs WHERE id = %s", (run.job_id,)) == {"approved": True}
    assert _transitions(jobs_db, run.job_id) == ["running", "waiting", "queued", "running", "succeeded"]


def test_a_lost_activation_is_found_by_the_reconciler(conn, pools, jobs_db):
    """The activation is recorded but its resume never happened (a writer that bypassed
    `activate`, or a wake-up that died with its process): the reconciler resumes the job."""
    metrics = JobsMetrics()
    pools({"approval": approval}, reconcile_interval_s=0.3, metrics=metrics)
    run = _start(conn, 1)
    wait_until(lambda: job_status(jobs_db, run.job_id) == "waiting", timeout_s=10)
    conn.execute("INSERT INTO job_activations (key, payload) VALUES ('approval:1', '{\"ok\": false}')")
    wait_until(lambda: job_status(jobs_db, run.job_id) == "succeeded", timeout_s=10,
               message="the reconciler did not resume the job")
    assert scalar(jobs_db, "SELECT result FROM jobs WHERE id = %s", (run.job_id,)) == {"approved": False}
    assert metrics.registry.get_sample_value(
        "outbox_jobs_resumed_total", {"queue": "interactive", "cause": "activation_lost"}) == 1


def test_a_duplicated_activation_advances_the_job_once(conn, jobs_db):
    run = _start(conn, 1)
    (job,) = claim_next(conn, "A", now=None)
    assert waits.park(conn, job.lease, WaitFor("approval:1", "approval")) == "waiting"

    results: list[Any] = []
    barrier = threading.Barrier(4)

    def deliver() -> None:
        with psycopg.connect(jobs_db, autocommit=True) as c:
            barrier.wait(10)
            results.append(activate(c, "approval:1", {"ok": True}))

    threads = [threading.Thread(target=deliver) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sum(r.recorded for r in results) == 1
    assert sum(len(r.resumed) for r in results) == 1
    assert activate(conn, "approval:1", {"ok": False}).resumed == ()  # later duplicates too
    assert not resume_job(conn, run.job_id)  # an API resume of a job no longer waiting: no-op
    (again,) = claim_next(conn, "B", now=None)
    assert (again.activation, again.wait_key) == ({"ok": True}, "approval:1")
    assert _transitions(jobs_db, run.job_id) == ["running", "waiting", "queued", "running"]


def test_an_activation_that_arrives_before_the_job_parks_still_resumes_it(conn, pools, jobs_db):
    activate(conn, "approval:1", {"ok": True})  # e.g. the approval came back very fast
    pools({"approval": approval})
    run = _start(conn, 1)
    wait_until(lambda: job_status(jobs_db, run.job_id) == "succeeded", timeout_s=10)
    assert scalar(jobs_db, "SELECT result FROM jobs WHERE id = %s", (run.job_id,)) == {"approved": True}
    assert "waiting" not in _transitions(jobs_db, run.job_id)


def test_a_wait_times_out_and_the_job_resumes_without_an_activation(conn, pools, jobs_db):
    metrics = JobsMetrics()
    pools({"approval": approval}, reconcile_interval_s=0.3, metrics=metrics)
    run = _start(conn, 1, timeout_s=0.5)
    wait_until(lambda: job_status(jobs_db, run.job_id) == "succeeded", timeout_s=15)
    assert scalar(jobs_db, "SELECT result FROM jobs WHERE id = %s", (run.job_id,)) == {
        "approved": False, "timed_out": True}
    assert metrics.registry.get_sample_value(
        "outbox_jobs_resumed_total", {"queue": "interactive", "cause": "timeout"}) == 1


def test_park_is_fenced_and_the_reconciler_pass_is_idempotent(conn, jobs_db):
    _start(conn, 1)
    (a,) = claim_next(conn, "A", now=at(0), lease_s=10)
    (b,) = claim_next(conn, "B", now=at(11), lease_s=10)
    assert waits.park(conn, a.lease, WaitFor("approval:1", "x"), now=at(12)) is None
    assert waits.park(conn, b.lease, WaitFor("approval:1", "x", timeout_s=5), now=at(12)) == "waiting"
    reconciler = Reconciler(queues=["interactive"], db_now=lambda: at(16))
    assert reconciler.run_once(conn).resumed_timeout == 0
    reconciler.db_now = lambda: at(18)
    assert reconciler.run_once(conn).resumed_timeout == 1
    assert reconciler.run_once(conn).resumed_timeout == 0
    assert job_status(jobs_db, a.id) == "queued"
    with pytest.raises(ValueError):
        WaitFor(None, "no condition")
    assert jobq.heartbeat(conn, worker="B", leases=[b.lease], lease_s=10, now=at(18)) == {b.id: "queued"}
