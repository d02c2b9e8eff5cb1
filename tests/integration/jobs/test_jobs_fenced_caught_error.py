"""A handler that catches a database error inside ``fenced_transaction()`` and carries on, on the
real PostgreSQL: the server aborted the transaction, and COMMIT of an aborted transaction answers
ROLLBACK without an error.  The block returned normally, nothing written, and the pool recorded
the job as succeeded.  Now the block raises (:mod:`consumer_sdk.jobs.aborted`): the handler's
own error is its failure (an attempt counted, a readable dead letter), a conflict or a
read-only database the database's (retried as when not caught)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus

from consumer_sdk.errors import TransactionConflict
from consumer_sdk.jobs import (
    Backoff,
    DatabaseReadOnly,
    FencedTransactionAborted,
    JobContext,
    NewJob,
    accept,
    enqueue,
    run_status,
)
from consumer_sdk.jobs import queue as jobq
from consumer_sdk.jobs.admin import dead_letters
from consumer_sdk.jobs.deferred import DeferringConnection
from consumer_sdk.jobs.model import ClaimedJob, Take
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import rows

INSERT = "INSERT INTO effects (job_id, token, step) VALUES (%(id)s, %(token)s, %(step)s)"
CAUGHT = "the handler caught a database error inside fenced_transaction() and carried on"


def _raise(sqlstate: str) -> str:
    """A real server error of ``sqlstate`` (PL/pgSQL's RAISE: the server aborts the transaction)."""
    return f"DO $$ BEGIN RAISE EXCEPTION 'raised as {sqlstate}' USING ERRCODE = '{sqlstate}'; END $$"


@pytest.fixture(params=[DeferringConnection, psycopg.Connection], ids=["pool_connection", "plain_connection"])
def any_conn(request: Any, jobs_db: str) -> Iterator[psycopg.Connection[Any]]:
    with request.param.connect(jobs_db, autocommit=True) as c:
        yield c


def _context(conn: psycopg.Connection[Any]) -> JobContext:
    enqueue(conn, [NewJob(owner_id="o1", queue="interactive", kind="work", payload={})])
    (job,) = jobq.claim(conn, worker="A", lease_s=60, takes=[
        Take(queue="interactive", owner_id="o1", n=1, owner_limit=jobq.NO_OWNER_LIMIT)])
    return JobContext(job, conn, deadline=float("inf"))


def _params(job: ClaimedJob, step: int) -> dict[str, int]:
    return {"id": job.id, "token": job.token, "step": step}


@pytest.mark.parametrize(("statement", "raised", "said"), [
    ("SELECT 1/0", FencedTransactionAborted, f"{CAUGHT}: 22012 division by zero; its transaction was "
                                             "rolled back, nothing written"),
    (_raise("40001"), TransactionConflict, "transaction aborted: 40001 raised as 40001"),
    (_raise("40P01"), TransactionConflict, "transaction aborted: 40P01 raised as 40P01"),
    (_raise("25006"), DatabaseReadOnly, "the database is read-only"),
], ids=["22012", "40001", "40P01", "25006"])
def test_a_caught_error_rolls_back_and_raises_what_it_stands_for(any_conn, jobs_db, statement, raised, said):
    ctx = _context(any_conn)
    job = ctx.job
    with pytest.raises(raised) as caught, ctx.fenced_transaction() as tx:
        tx.execute(INSERT, _params(job, 1))
        try:
            tx.execute(statement)
        except psycopg.Error:
            pass  # the handler carries on
    assert str(caught.value).startswith(said), caught.value
    assert isinstance(caught.value.__cause__, psycopg.Error)  # the error the handler caught
    assert any_conn.info.transaction_status == TransactionStatus.IDLE and not ctx.cancelled
    assert rows(jobs_db, "SELECT step FROM effects") == []
    # A savepoint the handler rolled back to leaves the transaction sound: it commits.
    with ctx.fenced_transaction() as tx:
        tx.execute(INSERT, _params(job, 2))
        try:
            with tx.transaction():
                tx.execute(statement)
        except psycopg.Error:
            pass
    assert rows(jobs_db, "SELECT step FROM effects") == [(2,)]


def test_a_caught_error_of_the_first_statement_is_seen_too(any_conn, jobs_db):
    """On the pool's connections the first statement goes with BEGIN and the fence, in a round
    trip whose errors are raised after it: the error is recorded there."""
    ctx = _context(any_conn)
    with pytest.raises(TransactionConflict, match="40P01"), ctx.fenced_transaction() as tx:
        try:
            tx.execute(_raise("40P01"))
        except psycopg.Error:
            pass
        try:
            tx.execute(INSERT, _params(ctx.job, 1))  # 25P02: a consequence, not what was caught
        except psycopg.errors.InFailedSqlTransaction:
            pass
    assert rows(jobs_db, "SELECT step FROM effects") == []


def test_the_pool_retries_a_job_whose_handler_caught_an_error_and_writes_its_effect_once(conn, pools, jobs_db):
    seen: list[tuple[str, int]] = []

    def handler(swallowed: str) -> Callable[[JobContext], Any]:
        def run(ctx: JobContext) -> Any:
            seen.append((ctx.job.kind, ctx.job.attempts))
            with ctx.fenced_transaction() as tx:
                tx.execute(INSERT, _params(ctx.job, ctx.job.attempts))
                if ctx.job.attempts == 1:
                    try:
                        tx.execute(swallowed)
                    except psycopg.Error:
                        pass
            return "done"
        return run

    pools({"own": handler("SELECT 1/0"), "conflict": handler(_raise("40001"))},
          backoff=Backoff(initial_s=0.05, max_s=0.1), poll_interval_s=5)
    runs = {kind: accept(conn, owner_id="o1", request_key=kind, kind=kind, body={}, max_attempts=attempts)
            for kind, attempts in (("own", 3), ("conflict", 3))}
    dead = accept(conn, owner_id="o1", request_key="dead", kind="own", body={}, max_attempts=1)
    states = {name: wait_until(lambda run=run: (s := run_status(conn, run.run_id)).terminal and s, timeout_s=15)
              for name, run in {**runs, "dead": dead}.items()}
    assert (states["own"].status, states["own"].attempts) == ("succeeded", 2)
    assert states["own"].last_error == (f"FencedTransactionAborted: {CAUGHT}: 22012 division by zero; "
                                        "its transaction was rolled back, nothing written")
    assert (states["conflict"].status, states["conflict"].attempts) == ("succeeded", 2)
    assert (states["conflict"].last_error or "").startswith(
        "TransactionConflict: transaction aborted: 40001 raised as 40001")
    effects = rows(jobs_db, "SELECT job_id, step FROM effects ORDER BY job_id")
    assert effects == [(runs["own"].job_id, 2), (runs["conflict"].job_id, 2)]  # once each, the 2nd attempt's
    assert (states["dead"].status, states["dead"].dead_reason) == ("failed", "attempts_exhausted")
    (record,) = dead_letters(conn)
    assert record.job_id == dead.job_id and record.error == states["own"].last_error
