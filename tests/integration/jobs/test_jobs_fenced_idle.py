"""A fenced transaction lives as long as the lease is renewed, however long the handler stays
idle in it (an external call), and ends with LeaseLost, not a driver error, when the lease is
not renewed any more; the job's outcome names what happened."""

from __future__ import annotations

import time
from typing import Any

import psycopg

from consumer_sdk.jobs import JobContext, JobsMetrics, LeaseLost, accept, run_status
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import rows

LEASE_S = 2.0


def _effect(conn: Any, ctx: JobContext, step: int) -> None:
    conn.execute("INSERT INTO effects (job_id, token, step) VALUES (%s, %s, %s)",
                  (ctx.job.id, ctx.job.token, step))


def test_a_fenced_transaction_idle_longer_than_the_lease_commits_while_the_lease_is_renewed(
        conn, jobs_db, pools):
    def slow_call(ctx: JobContext) -> Any:
        with ctx.fenced_transaction() as tx:
            _effect(tx, ctx, 1)
            time.sleep(LEASE_S * 2.5)  # noqa: TID251 - an external call, the transaction idle meanwhile
            _effect(tx, ctx, 2)
        return "ok"

    pools({"slow": slow_call}, lease_duration_s=LEASE_S)
    run = accept(conn, owner_id="o", request_key="k", kind="slow", body={})
    state = wait_until(lambda: (s := run_status(conn, run.run_id)).terminal and s, timeout_s=30,
                       message="the run did not end")
    assert (state.status, state.attempts) == ("succeeded", 1), state
    assert sorted(r[0] for r in rows(jobs_db, "SELECT step FROM effects")) == [1, 2]


def test_a_fenced_transaction_whose_lease_is_lost_ends_with_lease_lost(conn, jobs_db, pools):
    seen: list[BaseException] = []
    inside = []

    def slow_call(ctx: JobContext) -> Any:
        try:
            with ctx.fenced_transaction() as tx:
                _effect(tx, ctx, 1)
                inside.append(ctx.job.id)
                time.sleep(LEASE_S * 3)  # noqa: TID251 - not cooperative: the lease is lost meanwhile
                _effect(tx, ctx, 2)
        except Exception as exc:
            seen.append(exc)
            raise
        return "ok"

    metrics = JobsMetrics()
    pool = pools({"slow": slow_call}, lease_duration_s=LEASE_S, metrics=metrics)
    run = accept(conn, owner_id="o", request_key="k", kind="slow", body={})
    wait_until(lambda: inside, timeout_s=20, message="the handler did not start")
    with psycopg.connect(jobs_db, autocommit=True) as other:  # another worker takes the job over
        other.execute("UPDATE jobs SET lease_token = lease_token + 1 WHERE id = %s", (inside[0],))
    wait_until(lambda: seen and pool.outcomes["lost"] == 1, timeout_s=30,
               message=lambda: f"seen {seen}, outcomes {pool.outcomes}")
    assert isinstance(seen[0], LeaseLost) and seen[0].reason == "lease_lost", repr(seen[0])
    assert rows(jobs_db, "SELECT step FROM effects") == []  # nothing of the attempt committed
    assert metrics.registry.get_sample_value(
        "outbox_jobs_leases_lost_total", {"queue": "interactive", "reason": "lease_lost"}) == 1
    assert run_status(conn, run.run_id) is not None
