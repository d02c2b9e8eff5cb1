"""Issue 19: a fenced transaction on the pool's own connections sends BEGIN and the fence
with the handler's first statement (:mod:`consumer_sdk.jobs.deferred`), on the real
database: two round trips for a one-write transaction instead of three, the statement's
results as psycopg gives them, and every other way a handler can send a statement
(other cursors, COPY, savepoints, pipelines, ...) fenced before it runs, with the lease
held and with it lost."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.pq import PipelineStatus, TransactionStatus

from consumer_sdk.jobs import LeaseLost, NewJob, WorkerConfig, enqueue
from consumer_sdk.jobs import queue as jobq
from consumer_sdk.jobs._conn import pool_connect_factory
from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.deferred import (
    INTERNALS,
    TESTED_PSYCOPG,
    DeferringConnection,
    SpinningDeferringConnection,
)
from consumer_sdk.jobs.model import ClaimedJob, Take
from tests.integration.jobs._support import at, rows
from tests.integration.sdk._support import RoundTrips

# On another psycopg the deferral is off and fenced transactions take the eager path, which
# the rest of the jobs tests cover; tests/unit/jobs/test_jobs_wire.py fails there to say so.
pytestmark = pytest.mark.skipif(not INTERNALS, reason=f"psycopg {psycopg.__version__}: the deferred fence is on "
                                f"only for {'.'.join(map(str, TESTED_PSYCOPG))} (constraints.txt pins it)")

INSERT = "INSERT INTO effects (job_id, token, step) VALUES (%(id)s, %(token)s, %(step)s)"


@pytest.fixture
def dconn(jobs_db: str) -> Iterator[DeferringConnection]:
    with DeferringConnection.connect(jobs_db, autocommit=True) as c:
        yield c


def _job(conn: psycopg.Connection[Any], **claim: Any) -> ClaimedJob:
    enqueue(conn, [NewJob(owner_id="o1", queue="interactive", kind="work", payload={})])
    (job,) = jobq.claim(conn, worker="A", takes=[Take(queue="interactive", owner_id="o1", n=1,
                                                       owner_limit=jobq.NO_OWNER_LIMIT)], **claim)
    return job


def _idle(conn: psycopg.Connection[Any]) -> bool:
    return (conn.info.transaction_status == TransactionStatus.IDLE
            and conn.pgconn.pipeline_status == PipelineStatus.OFF)


def _params(job: ClaimedJob, step: int) -> dict[str, int]:
    return {"id": job.id, "token": job.token, "step": step}


def test_a_one_write_fenced_transaction_costs_two_round_trips(dconn, jobs_db):
    job = _job(dconn, lease_s=60)  # the database's clock, as in production
    ctx = JobContext(job, dconn, deadline=float("inf"))
    with RoundTrips(dconn) as first, ctx.fenced_transaction() as tx:  # prepares the fence: once
        tx.execute(INSERT, _params(job, 1))
    assert first.count == 3 and any("PREPARE" in text for text in first.sent), first.sent
    with RoundTrips(dconn) as trips, ctx.fenced_transaction() as tx:
        cur = tx.execute(INSERT + " RETURNING step, token", _params(job, 2))
        # The statement's results, as psycopg's own execute gives them.
        assert cur.rowcount == 1 and cur.description is not None and cur.description[0].name == "step"
        assert cur.fetchall() == [(2, job.token)]
        assert tx.info.transaction_status == TransactionStatus.INTRANS
        assert tx.execute("SELECT count(*) FROM effects").fetchone() == (2,)  # the same transaction
    assert trips.count == 3, trips.sent  # with BEGIN and the fence, the read, COMMIT
    assert sum("BEGIN" in text for text in trips.sent) == 1, trips.sent
    with RoundTrips(dconn) as trips, ctx.fenced_transaction() as tx:
        with tx.cursor() as c:  # a cursor of the connection's factory: the same way
            c.execute(INSERT, _params(job, 3))
            assert c.rowcount == 1
    assert trips.count == 2, trips.sent
    assert _idle(dconn) and not ctx.cancelled
    assert rows(jobs_db, "SELECT step, token FROM effects ORDER BY step") == [
        (1, job.token), (2, job.token), (3, job.token)]


def test_a_lost_lease_refuses_the_first_statement_and_nothing_runs(dconn, jobs_db):
    job = _job(dconn, now=at(0), lease_s=10)
    ctx = JobContext(job, dconn, deadline=float("inf"), db_now=lambda: at(5))
    with ctx.fenced_transaction() as tx:
        tx.execute(INSERT, _params(job, 1))
    late = JobContext(job, dconn, deadline=float("inf"), db_now=lambda: at(10.5))  # ran out, not taken
    reached: list[str] = []
    with pytest.raises(LeaseLost, match=f"job {job.id}"), late.fenced_transaction() as tx:
        tx.execute(INSERT, _params(job, 2))
        reached.append("after the first statement")
    assert reached == [] and late.cancelled and late.cancel_reason == "lease_lost"
    assert _idle(dconn)
    with pytest.raises(LeaseLost):  # a cancelled context refuses before sending anything
        with late.fenced_transaction() as tx:
            tx.execute(INSERT, _params(job, 3))
    with ctx.fenced_transaction() as tx:  # the connection is fine
        tx.execute(INSERT, _params(job, 4))
    assert rows(jobs_db, "SELECT step FROM effects ORDER BY step") == [(1,), (4,)]


def _copy(ctx: JobContext, tx: psycopg.Connection[Any], p: dict[str, int]) -> None:
    with tx.cursor() as cur, cur.copy("COPY effects (job_id, token, step) FROM STDIN") as copy:
        copy.write_row((p["id"], p["token"], p["step"]))


def _server_cursor(ctx: JobContext, tx: psycopg.Connection[Any], p: dict[str, int]) -> None:
    with tx.cursor(name="deferred_reader") as cur:  # DECLARE: the first statement sent
        cur.execute("SELECT count(*) FROM effects")
        cur.fetchall()
    tx.execute(INSERT, p)


def _savepoint(ctx: JobContext, tx: psycopg.Connection[Any], p: dict[str, int]) -> None:
    with tx.transaction():  # a savepoint in the fenced transaction, not a transaction of its own
        tx.execute(INSERT, p)


def _pipeline(ctx: JobContext, tx: psycopg.Connection[Any], p: dict[str, int]) -> None:
    with tx.pipeline():
        tx.execute(INSERT, p)


def _savepoint_in_pipeline(ctx: JobContext, tx: psycopg.Connection[Any], p: dict[str, int]) -> None:
    with tx.pipeline(), tx.transaction():
        tx.execute(INSERT, p)


def _executemany(ctx: JobContext, tx: psycopg.Connection[Any], p: dict[str, int]) -> None:
    with tx.cursor() as cur:
        cur.executemany(INSERT, [p])


WAYS: dict[str, Callable[[JobContext, psycopg.Connection[Any], dict[str, int]], None]] = {
    "execute": lambda ctx, tx, p: tx.execute(INSERT, p) and None,
    "binary": lambda ctx, tx, p: tx.execute(INSERT, p, binary=True) and None,
    "prepare": lambda ctx, tx, p: tx.execute(INSERT, p, prepare=True) and None,
    "client_cursor": lambda ctx, tx, p: psycopg.ClientCursor(tx).execute(INSERT, p) and None,
    "put_result": lambda ctx, tx, p: ctx.put_result(f"step-{p['step']}", p["step"]),
    "executemany": _executemany,
    "copy": _copy,
    "server_cursor": _server_cursor,
    "savepoint": _savepoint,
    "pipeline": _pipeline,
    "savepoint_in_pipeline": _savepoint_in_pipeline,
    "client_cursor_executemany": lambda ctx, tx, p: psycopg.ClientCursor(tx).executemany(INSERT, [p]),
}


@pytest.mark.parametrize("way", sorted(WAYS))
def test_every_way_of_sending_a_statement_is_fenced(dconn, jobs_db, way):
    """Held: written and committed once.  Lost: LeaseLost before anything runs, nothing
    written.  The connection is in autocommit: a statement sent around the fence would
    have committed on its own."""
    send = WAYS[way]
    written = ("SELECT count(*) FROM job_results" if way == "put_result"
               else "SELECT count(*) FROM effects")
    job = _job(dconn, now=at(0), lease_s=10)
    ctx = JobContext(job, dconn, deadline=float("inf"), db_now=lambda: at(5))
    with ctx.fenced_transaction() as tx:
        send(ctx, tx, _params(job, 1))
    assert _idle(dconn) and rows(jobs_db, written) == [(1,)]
    late = JobContext(job, dconn, deadline=float("inf"), db_now=lambda: at(10.5))
    with pytest.raises(LeaseLost), late.fenced_transaction() as tx:
        send(late, tx, _params(job, 2))
    assert _idle(dconn) and rows(jobs_db, written) == [(1,)]


def test_the_statements_own_error_is_raised_and_nothing_is_written(dconn, jobs_db):
    job = _job(dconn, lease_s=60)
    ctx = JobContext(job, dconn, deadline=float("inf"))
    with pytest.raises(psycopg.errors.UndefinedTable), ctx.fenced_transaction() as tx:
        tx.execute("INSERT INTO no_such_table VALUES (%s)", (1,))
    assert not ctx.cancelled and _idle(dconn)
    with pytest.raises(psycopg.errors.NotNullViolation), ctx.fenced_transaction() as tx:
        tx.execute(INSERT, _params(job, 1))
        tx.execute(INSERT, {"id": job.id, "token": None, "step": 2})  # a later statement fails
    assert not ctx.cancelled and _idle(dconn)
    with ctx.fenced_transaction() as tx:  # the prepared fence may have gone with the rollback
        tx.execute(INSERT, _params(job, 3))
    assert rows(jobs_db, "SELECT step FROM effects") == [(3,)]


def test_the_job_row_is_locked_from_the_first_statement_to_the_commit(dconn, jobs_db):
    job = _job(dconn, lease_s=60)
    ctx = JobContext(job, dconn, deadline=float("inf"))
    with psycopg.connect(jobs_db, autocommit=True) as other:
        takeover = "SELECT 1 FROM jobs WHERE id = %s FOR UPDATE NOWAIT"
        with ctx.fenced_transaction() as tx:
            assert other.execute(takeover, (job.id,)).fetchall() == [(1,)]  # nothing sent yet
            assert not ctx.keep_fence_alive()  # no transaction to keep alive yet
            tx.execute(INSERT, _params(job, 1))
            with pytest.raises(psycopg.errors.LockNotAvailable):
                other.execute(takeover, (job.id,))
            assert ctx.keep_fence_alive()
        assert other.execute(takeover, (job.id,)).fetchall() == [(1,)]


def test_a_block_that_sends_nothing_sends_nothing(dconn):
    job = _job(dconn, lease_s=60)
    ctx = JobContext(job, dconn, deadline=float("inf"))
    with ctx.fenced_transaction():  # prepares the fence: once per connection
        pass
    with RoundTrips(dconn) as trips, ctx.fenced_transaction():
        pass
    assert trips.count == 0
    with RoundTrips(dconn) as trips, pytest.raises(ValueError), ctx.fenced_transaction():
        raise ValueError("the handler's own")
    assert trips.count == 0 and _idle(dconn) and dconn.deferred is None


def test_a_prepared_fence_that_vanished_is_prepared_again(dconn, jobs_db):
    job = _job(dconn, lease_s=60)
    ctx = JobContext(job, dconn, deadline=float("inf"))
    with ctx.fenced_transaction() as tx:
        tx.execute(INSERT, _params(job, 1))
    dconn.execute("DEALLOCATE ALL")  # DISCARD ALL, or a pooler's other server session
    with ctx.fenced_transaction() as tx:
        assert tx.execute(INSERT, _params(job, 2)).rowcount == 1
    assert _idle(dconn) and not ctx.cancelled
    assert rows(jobs_db, "SELECT step FROM effects ORDER BY step") == [(1,), (2,)]


def test_without_migration_0012_it_takes_three_round_trips(dconn, jobs_db):
    dconn.execute("DROP FUNCTION outbox_jobs_fence(bigint, bigint, timestamptz)")
    job = _job(dconn, now=at(0), lease_s=10)
    ctx = JobContext(job, dconn, deadline=float("inf"), db_now=lambda: at(1))
    with ctx.fenced_transaction() as tx:
        tx.execute(INSERT, _params(job, 1))
    with RoundTrips(dconn) as trips, ctx.fenced_transaction() as tx:
        tx.execute(INSERT, _params(job, 2))
    assert trips.count == 3, trips.sent  # BEGIN with the fence, the statement, COMMIT
    late = JobContext(job, dconn, deadline=float("inf"), db_now=lambda: at(11))
    with pytest.raises(LeaseLost), late.fenced_transaction() as tx:
        tx.execute(INSERT, _params(job, 3))
    assert rows(jobs_db, "SELECT step FROM effects ORDER BY step") == [(1,), (2,)]


def test_the_pools_connections_defer_the_fence(jobs_db):
    for spin_us, cls in ((0, DeferringConnection), (50, SpinningDeferringConnection)):
        make = pool_connect_factory(WorkerConfig(dsn=jobs_db, db_spin_us=spin_us))
        with make() as conn:
            assert isinstance(conn, cls) and conn.autocommit  # a subclass: its waits timed (statement_clock)
            assert isinstance(conn, SpinningDeferringConnection) == (spin_us > 0)
            assert conn.execute("SELECT 1").fetchone() == (1,)  # no fence: a plain cursor's execute


def test_a_handler_that_swallows_the_refusal_cannot_write_around_the_fence(dconn, jobs_db):
    """The connection is in autocommit: after the fence refused, a statement sent as if
    nothing happened would commit on its own.  Every later one is refused too, and the
    block raises LeaseLost at its end even when the handler caught every error."""
    job = _job(dconn, now=at(0), lease_s=10)
    late = JobContext(job, dconn, deadline=float("inf"), db_now=lambda: at(10.5))
    caught: list[type[BaseException]] = []
    with pytest.raises(LeaseLost), late.fenced_transaction() as tx:
        for send in (lambda: tx.execute(INSERT, _params(job, 1)),
                     lambda: psycopg.ClientCursor(tx).execute(INSERT, _params(job, 2)),
                     lambda: tx.transaction().__enter__()):
            try:
                send()
            except LeaseLost as exc:
                caught.append(type(exc))
        assert not late.keep_fence_alive()  # refused: nothing to keep alive, nothing raised
    assert caught == [LeaseLost] * 3
    assert _idle(dconn) and rows(jobs_db, "SELECT count(*) FROM effects") == [(0,)]


def test_a_fence_that_fails_leaves_nothing_to_write_around_it(dconn, jobs_db):
    job = _job(dconn, lease_s=60)
    ctx = JobContext(job, dconn, deadline=float("inf"))
    with ctx.fenced_transaction() as tx:
        tx.execute(INSERT, _params(job, 1))  # prepares the fence
    dconn.execute("SET lock_timeout = '50ms'")
    with psycopg.connect(jobs_db) as other:
        other.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (job.id,))  # a takeover holds it
        errors: list[str] = []
        with pytest.raises(psycopg.ProgrammingError, match="could not begin"), ctx.fenced_transaction() as tx:
            for step in (2, 3):
                try:
                    tx.execute(INSERT, _params(job, step))
                except psycopg.Error as exc:
                    errors.append(type(exc).__name__)
        assert errors == ["LockNotAvailable", "ProgrammingError"]
    dconn.execute("RESET lock_timeout")
    assert _idle(dconn) and not ctx.cancelled
    assert rows(jobs_db, "SELECT step FROM effects ORDER BY step") == [(1,)]


def test_a_first_statement_that_cannot_be_bound_leaves_the_fence_for_the_next(dconn, jobs_db):
    job = _job(dconn, lease_s=60)
    ctx = JobContext(job, dconn, deadline=float("inf"))
    with ctx.fenced_transaction() as tx:
        with pytest.raises(psycopg.ProgrammingError):  # a parameter missing: nothing sent
            tx.execute(INSERT, {"id": job.id})
        assert dconn.deferred is not None and dconn.deferred.pending
        tx.execute(INSERT, _params(job, 1))
        assert tx.info.transaction_status == TransactionStatus.INTRANS  # fenced, not autocommitted
    assert rows(jobs_db, "SELECT step FROM effects") == [(1,)]


def test_the_first_statement_is_prepared_as_psycopg_would_prepare_it(dconn, jobs_db):
    """psycopg prepares a statement after ``prepare_threshold`` executions (5); the first
    statement of a fenced transaction goes the same way, in its one round trip."""
    job = _job(dconn, lease_s=60)
    ctx = JobContext(job, dconn, deadline=float("inf"))
    sent: list[list[str]] = []
    for step in range(1, 8):
        with RoundTrips(dconn) as trips, ctx.fenced_transaction() as tx:
            assert tx.execute(INSERT + " RETURNING step", _params(job, step)).fetchone() == (step,)
        sent.append([line for line in trips.lines if line.startswith("F\t") and "\tParse\t" in line])
    named = [i for i, parses in enumerate(sent) if any('"_pg3_' in line for line in parses)]
    assert named == [5], sent  # prepared once, at the sixth execution
    assert not any("INSERT" in line for line in sent[6]), sent[6]  # then run by its name
    dconn.execute("DEALLOCATE ALL")  # psycopg forgets its own, the fence is prepared again
    with ctx.fenced_transaction() as tx:
        tx.execute(INSERT, _params(job, 8))
    assert rows(jobs_db, "SELECT count(*) FROM effects") == [(8,)]


def test_write_event_may_be_the_first_statement_of_a_fenced_transaction(dconn, jobs_db):
    # It refused with TransactionRequired: BEGIN, held back until the first statement, had
    # not been sent, so the autocommit connection looked outside a transaction (an audit
    # of the worker pool; enqueue, activate and accept went through).
    from consumer_sdk import write_event

    job = _job(dconn, now=at(0), lease_s=10)
    ctx = JobContext(job, dconn, deadline=float("inf"), db_now=lambda: at(5))
    with ctx.fenced_transaction() as tx:
        write_event(tx, topic="t.jobs", key="k", payload={"step": 1})
    late = JobContext(job, dconn, deadline=float("inf"), db_now=lambda: at(10.5))
    with pytest.raises(LeaseLost), late.fenced_transaction() as tx:
        write_event(tx, topic="t.jobs", key="k", payload={"step": 2})
    assert _idle(dconn)
    assert rows(jobs_db, "SELECT payload::text FROM outbox") == [('{"step": 1}',)]
