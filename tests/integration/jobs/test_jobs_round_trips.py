"""Issue 19: a job's statements in round trips on the real database.  A fenced transaction
with one write costs three on a plain psycopg connection (BEGIN with the fence's prepared
lock in one simple query, the write, COMMIT; before: four; the first on a connection
prepares the lock, one more; on the pool's own connections, two:
test_jobs_deferred_fence.py),
and a claim two (BEGIN with the owners' locks, the claim with COMMIT; before: four), or
one when no owner limit can bind (the claim alone), still
refusing a stale lease and leaving no transaction open either way."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus

from consumer_sdk import _wire
from consumer_sdk.jobs import LeaseLost, NewJob, claims, enqueue
from consumer_sdk.jobs import queue as jobq
from consumer_sdk.jobs._db import q
from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.model import JobId, Take, Token
from tests.integration.jobs._support import at, rows
from tests.integration.sdk._support import RoundTrips


def _enqueue(conn: psycopg.Connection[Any], n: int) -> None:
    enqueue(conn, [NewJob(owner_id="o1", queue="interactive", kind="work", payload={"i": i})
                   for i in range(n)], now=at(0))


def test_a_claim_of_several_jobs_costs_two_round_trips(conn):
    _enqueue(conn, 3)
    with RoundTrips(conn) as trips:
        claimed = jobq.claim(conn, worker="A", takes=[Take(queue="interactive", owner_id="o1", n=3,
                                                            owner_limit=10)], lease_s=10, now=at(1))
    assert len(claimed) == 3 and trips.count == 2
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert rows(conn.info.dsn, "SELECT count(*) FROM jobs WHERE status = 'running' AND lease_owner = 'A'") \
        == [(3,)]


def test_without_an_owner_limit_a_claim_is_one_statement(conn):
    _enqueue(conn, 3)
    with RoundTrips(conn) as trips:
        claimed = jobq.claim(conn, worker="A", takes=[Take(queue="interactive", owner_id="o1", n=2,
                                                            owner_limit=jobq.NO_OWNER_LIMIT)],
                             lease_s=10, now=at(1))
    assert len(claimed) == 2 and trips.count == 1
    assert not any("lock" in text for text in trips.sent)
    assert conn.info.transaction_status == TransactionStatus.IDLE


def test_a_claim_inside_the_callers_transaction_is_refused(conn):
    with conn.transaction(), pytest.raises(RuntimeError, match="own transaction"):
        jobq.claim(conn, worker="A", takes=[Take(queue="interactive", owner_id="o1", n=1, owner_limit=1)],
                   lease_s=10, now=at(1))


def test_a_fenced_transaction_with_one_write_costs_three_round_trips(conn, jobs_db):
    conn.execute("CREATE TABLE rt_effects (job_id bigint, token bigint)")
    _enqueue(conn, 1)
    # On the database's clock (production): BEGIN and the prepared fence in one simple query.
    enqueue(conn, [NewJob(owner_id="o2", queue="interactive", kind="work", payload={})])
    (live,) = jobq.claim(conn, worker="A", takes=[Take(queue="interactive", owner_id="o2", n=1,
                                                       owner_limit=1)], lease_s=60)
    live_ctx = ctx = JobContext(live, conn, deadline=float("inf"))
    with RoundTrips(conn) as first, ctx.fenced_transaction() as tx:  # prepares the fence: once
        tx.execute("INSERT INTO rt_effects VALUES (%s, %s)", (live.id, live.token))
    assert first.count == 4 and any("PREPARE" in text for text in first.sent)
    with RoundTrips(conn) as trips, ctx.fenced_transaction() as tx:
        tx.execute("INSERT INTO rt_effects VALUES (%s, %s)", (live.id, live.token))
    assert trips.count == 3, trips.sent
    assert not any("PREPARE" in text for text in trips.sent)
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert rows(jobs_db, "SELECT job_id, token FROM rt_effects") == [(live.id, live.token)] * 2
    conn.execute("DELETE FROM rt_effects")

    # On a test's clock: BEGIN and the fence's lock in a pipeline, three round trips too.
    (job,) = jobq.claim(conn, worker="A", takes=[Take(queue="interactive", owner_id="o1", n=1, owner_limit=2)],
                        lease_s=10, now=at(1))
    ctx = JobContext(job, conn, deadline=float("inf"), db_now=lambda: at(2))
    with RoundTrips(conn) as trips, ctx.fenced_transaction() as tx:
        tx.execute("INSERT INTO rt_effects VALUES (%s, %s)", (job.id, job.token))
    assert trips.count == 3, trips.sent
    assert rows(jobs_db, "SELECT job_id, token FROM rt_effects") == [(job.id, job.token)]
    ctx = JobContext(job, conn, deadline=float("inf"), db_now=lambda: at(2))
    with ctx.fenced_transaction() as tx:
        tx.execute("INSERT INTO rt_effects VALUES (%s, %s)", (job.id, job.token))
    assert rows(jobs_db, "SELECT job_id, token FROM rt_effects") == [(job.id, job.token)] * 2

    late = JobContext(job, conn, deadline=float("inf"), db_now=lambda: at(20))  # the lease ran out
    with pytest.raises(LeaseLost), late.fenced_transaction() as tx:
        tx.execute("INSERT INTO rt_effects VALUES (%s, %s)", (job.id, -1))
    assert conn.info.transaction_status == TransactionStatus.IDLE

    failing = JobContext(job, conn, deadline=float("inf"), db_now=lambda: at(3))
    with pytest.raises(psycopg.errors.UndefinedTable), failing.fenced_transaction() as tx:
        tx.execute("INSERT INTO rt_effects VALUES (%s, %s)", (job.id, -2))
        tx.execute("INSERT INTO no_such_table VALUES (1)")
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert rows(jobs_db, "SELECT job_id, token FROM rt_effects") == [(job.id, job.token)] * 2

    conn.execute("DEALLOCATE ALL")  # the prepared fence is gone: found out, prepared again
    with RoundTrips(conn) as trips, live_ctx.fenced_transaction() as tx:
        tx.execute("INSERT INTO rt_effects VALUES (%s, %s)", (live.id, live.token))
    assert trips.count == 6 and conn.info.transaction_status == TransactionStatus.IDLE
    assert rows(jobs_db, "SELECT count(*) FROM rt_effects") == [(3,)]


def test_a_claim_updates_by_primary_key_not_by_scanning_the_table(conn):
    """The claim's UPDATE joined the picked ids; planned for ~30 rows, it hash-joined a
    sequential scan of every job, finished ones included (a claim growing with the table)."""
    enqueue(conn, [NewJob(owner_id=f"o{i % 50}", queue="bulk", kind="work", payload={"i": i})
                   for i in range(5000)], now=at(0))
    conn.execute("ANALYZE jobs")
    takes = [Take("bulk", owner, 1, jobq.NO_OWNER_LIMIT) for owner in ("o1", "o2", "o3")]
    done = [jobq.Done(JobId(i), Token(1), "null") for i in (1, 2)]
    params = claims._claim_params(takes, done, "A", 10.0, at(1))
    plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + q("claim"), params).fetchall())  # claims nothing
    assert "Seq Scan on jobs" not in plan, plan
    assert "jobs_pkey" in plan, plan
    # The completions (in the claim, or alone) probe an index too: the primary key or the
    # small one of running jobs, never every job kept; so does the question after a lost reply.
    plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + q("complete_many"),
                                                 claims._done_params(done, "A", at(1))).fetchall())
    assert "Seq Scan on jobs" not in plan and ("jobs_pkey" in plan or "jobs_running_idx" in plan), plan
    plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + q("completed_by_lease"),
                                                 {"done": "[[1,1],[2,1]]", "worker": "A"}).fetchall())
    assert "Seq Scan on jobs" not in plan and "jobs_pkey" in plan, plan


def test_without_pipeline_mode_a_fenced_transaction_and_a_claim_still_work(conn, jobs_db, monkeypatch):
    """libpq < 14 has no pipeline mode: the statements go one by one, with the same effects."""
    monkeypatch.setattr(psycopg.capabilities, "has_pipeline", lambda check=False: False)
    conn.execute("CREATE TABLE rt_effects (job_id bigint, token bigint)")
    _enqueue(conn, 1)
    with RoundTrips(conn) as trips:
        (job,) = jobq.claim(conn, worker="A", takes=[Take(queue="interactive", owner_id="o1", n=1,
                                                           owner_limit=1)], lease_s=10, now=at(1))
    assert trips.count == 4
    ctx = JobContext(job, conn, deadline=float("inf"), db_now=lambda: at(2))
    with RoundTrips(conn) as trips, ctx.fenced_transaction() as tx:  # the fence needs no pipeline
        tx.execute("INSERT INTO rt_effects VALUES (%s, %s)", (job.id, job.token))
    assert trips.count == 4 and conn.info.transaction_status == TransactionStatus.IDLE  # with PREPARE
    assert rows(jobs_db, "SELECT job_id, token FROM rt_effects") == [(job.id, job.token)]


def test_where_the_fence_cannot_stay_prepared_it_goes_in_a_pipeline(conn, jobs_db, monkeypatch):
    """A pooler that moves sessions between servers loses prepared statements: the fence
    falls back to BEGIN and the lock in a pipeline, fenced all the same."""
    monkeypatch.setattr(jobq, "_prepare_fence", lambda conn: None)  # never really prepared
    conn.execute("CREATE TABLE rt_effects (job_id bigint, token bigint)")
    _enqueue(conn, 1)
    (job,) = jobq.claim(conn, worker="A", takes=[Take(queue="interactive", owner_id="o1", n=1,
                                                       owner_limit=1)], lease_s=10, now=at(1))
    ctx = JobContext(job, conn, deadline=float("inf"), db_now=lambda: at(2))
    with ctx.fenced_transaction() as tx:
        tx.execute("INSERT INTO rt_effects VALUES (%s, %s)", (job.id, job.token))
    late = JobContext(job, conn, deadline=float("inf"), db_now=lambda: at(20))
    with pytest.raises(LeaseLost), late.fenced_transaction() as tx:
        tx.execute("INSERT INTO rt_effects VALUES (%s, %s)", (job.id, -1))
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert rows(jobs_db, "SELECT job_id, token FROM rt_effects") == [(job.id, job.token)]


def test_a_fence_that_fails_on_the_server_leaves_the_connection_usable(conn, jobs_db):
    """The fence's pipeline (BEGIN and the prepared lock, below psycopg's cursor) raises the
    server's error as psycopg would, and leaves the connection idle, out of pipeline mode."""
    conn.execute("CREATE TABLE rt_effects (job_id bigint, token bigint)")
    enqueue(conn, [NewJob(owner_id="o1", queue="interactive", kind="work", payload={})])
    (job,) = jobq.claim(conn, worker="A", takes=[Take(queue="interactive", owner_id="o1", n=1,
                                                       owner_limit=1)], lease_s=60)
    ctx = JobContext(job, conn, deadline=float("inf"))
    conn.execute("SET lock_timeout = '50ms'")
    with psycopg.connect(jobs_db) as other:  # a takeover's FOR UPDATE, held
        other.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (job.id,))
        with pytest.raises(psycopg.errors.LockNotAvailable), ctx.fenced_transaction() as tx:
            tx.execute("INSERT INTO rt_effects VALUES (%s, %s)", (job.id, -1))
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert conn.pgconn.pipeline_status == psycopg.pq.PipelineStatus.OFF and not ctx.cancelled
    with ctx.fenced_transaction() as tx:
        tx.execute("INSERT INTO rt_effects VALUES (%s, %s)", (job.id, job.token))
    assert rows(jobs_db, "SELECT job_id, token FROM rt_effects") == [(job.id, job.token)]


def test_the_fence_statement_is_the_one_jobs_sql_prepares():
    assert q("fence_prepare").startswith(f"PREPARE {jobq.FENCE_STATEMENT.decode()} (")


def test_a_connection_takes_the_fence_pipeline(conn):
    """The fast path is the one the other tests here exercise (the connection's lock is an
    instance attribute: only a real connection shows it)."""
    assert _wire.available(conn)
