"""Test 5 of the issue, and the lock behind the fenced transaction, with controlled time.

Time is `%(now)s` in every statement: A claims at t=0 for 10 s, B's claim at t=5 is
refused, B claims at t=11 with token 2, A's late result at t=12 is rejected, B's is
stored.  Then the same for the handler's own writes (fenced transactions), and the
row lock that keeps a takeover from slipping in between the check and the commit.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from consumer_sdk.jobs import LeaseLost, accept, cancel_run, run_status
from consumer_sdk.jobs import queue as jobq
from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.model import Take
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import at, claim_next, rows, scalar


def _run(conn: psycopg.Connection[Any]) -> Any:
    return accept(conn, owner_id="owner-1", request_key="req-1", kind="work", body={"n": 1})


def test_a_stale_owner_is_refused_and_the_new_owner_is_stored(conn, jobs_db):
    run = _run(conn)
    (a,) = claim_next(conn, "A", now=at(0), lease_s=10)
    assert (a.token, a.attempts) == (1, 1)

    assert claim_next(conn, "B", now=at(5), lease_s=10) == []  # A's lease holds until t=10

    (b,) = claim_next(conn, "B", now=at(11), lease_s=10)
    assert (b.id, b.token, b.attempts) == (a.id, 2, 2)

    assert jobq.complete(conn, a.lease, result="late", now=at(12)) is None
    assert jobq.heartbeat(conn, worker="A", leases=[a.lease], lease_s=10, now=at(12)) == {a.id: "running"}
    assert jobq.complete(conn, b.lease, result="current", now=at(12)) is not None

    state = run_status(conn, run.run_id)
    assert (state.status, state.result) == ("succeeded", "current")
    # A's later writes of any kind match nothing either.
    assert jobq.retry(conn, a.lease, error="x", error_type="X", backoff_s=1, now=at(13)) is None
    assert jobq.fail(conn, a.lease, reason="permanent_error", error="x", error_type="X", now=at(13)) is None
    assert scalar(jobs_db, "SELECT count(*) FROM job_dead_letters") == 0


def test_a_lease_expired_but_not_yet_taken_over_still_refuses_writes(conn):
    _run(conn)
    (a,) = claim_next(conn, "A", now=at(0), lease_s=10)
    # Nobody claimed it yet, but the lease ran out: authority is gone all the same.
    assert jobq.complete(conn, a.lease, result="late", now=at(10.5)) is None
    assert jobq.heartbeat(conn, worker="A", leases=[a.lease], lease_s=10, now=at(10.5)) == {a.id: "running"}


def test_the_handlers_own_writes_are_fenced_by_the_same_lease(conn, jobs_db):
    _run(conn)
    (a,) = claim_next(conn, "A", now=at(0), lease_s=10)
    ctx_a = JobContext(a, conn, deadline=float("inf"), db_now=lambda: at(9))
    with ctx_a.fenced_transaction() as tx:
        tx.execute("INSERT INTO effects (job_id, token, step) VALUES (%s, %s, 1)", (a.id, a.token))

    with psycopg.connect(jobs_db, autocommit=True) as other:
        (b,) = claim_next(other, "B", now=at(11), lease_s=10)

    late = JobContext(a, conn, deadline=float("inf"), db_now=lambda: at(12))
    with pytest.raises(LeaseLost):
        with late.fenced_transaction() as tx:
            pytest.fail("the block must not run without the lease")
    assert late.cancelled and late.cancel_reason == "lease_lost"
    with pytest.raises(LeaseLost):
        late.put_result("page-1", "from A")

    ctx_b = JobContext(b, conn, deadline=float("inf"), db_now=lambda: at(12))
    ctx_b.put_result("page-1", "from B")
    ctx_b.put_result("page-1", "from B again")  # by key: overwritten, not added
    assert rows(jobs_db, "SELECT key, value, lease_token FROM job_results") == [("page-1", "from B again", 2)]
    assert rows(jobs_db, "SELECT token, step FROM effects") == [(1, 1)]


def test_an_open_fenced_transaction_blocks_the_takeover_but_not_the_heartbeat(conn, jobs_db):
    _run(conn)
    (a,) = claim_next(conn, "A", now=at(0), lease_s=10)
    ctx = JobContext(a, conn, deadline=float("inf"), db_now=lambda: at(9))
    with psycopg.connect(jobs_db, autocommit=True) as other:
        other.execute("SET lock_timeout = '2s'")  # a blocked statement would fail, not hang
        with ctx.fenced_transaction() as tx:
            tx.execute("INSERT INTO effects (job_id, token, step) VALUES (%s, %s, 1)", (a.id, a.token))
            # The lease is past its end at t=11, but the row is locked: no takeover now.
            assert claim_next(other, "B", now=at(11), lease_s=10) == []
            # A's own heartbeat is not blocked by its handler's transaction.
            assert jobq.heartbeat(other, worker="A", leases=[a.lease], lease_s=10, now=at(9.5)) == {}
        # Committed while A held the lease.  Renewed to t=19.5: B still waits.
        assert claim_next(other, "B", now=at(11), lease_s=10) == []
        (b,) = claim_next(other, "B", now=at(20), lease_s=10)
        assert b.token == 2
    assert rows(jobs_db, "SELECT token FROM effects") == [(1,)]


def test_cancellation_waits_for_an_open_fenced_transaction(conn, jobs_db):
    run = _run(conn)
    (a,) = claim_next(conn, "A", now=None, lease_s=30)
    ctx = JobContext(a, conn, deadline=float("inf"))
    done = threading.Event()
    with ctx.fenced_transaction() as tx:
        tx.execute("INSERT INTO effects (job_id, token, step) VALUES (%s, %s, 1)", (a.id, a.token))

        def cancel() -> None:
            with psycopg.connect(jobs_db, autocommit=True) as owner:
                cancel_run(owner, owner_id="owner-1", run_id=run.run_id)
            done.set()

        thread = threading.Thread(target=cancel)
        thread.start()
        wait_until(lambda: scalar(jobs_db, "SELECT count(*) FROM pg_stat_activity "
                                           "WHERE wait_event_type = 'Lock' AND datname = current_database()"),
                   timeout_s=10, message="the cancellation never waited for the fenced transaction")
        assert not done.is_set()
    thread.join(10)
    assert done.is_set()
    assert run_status(conn, run.run_id).status == "cancelled"
    assert jobq.heartbeat(conn, worker=a.worker, leases=[a.lease], lease_s=30) == {a.id: "cancelled"}
    with pytest.raises(LeaseLost):
        with ctx.fenced_transaction():
            pass


def test_a_heartbeat_that_meets_its_own_completion_reports_nothing_lost(conn):
    """The heartbeat lists the leases of running attempts, then renews them; an attempt whose
    completion commits in between was reported as a lost lease (a false warning, and the
    attempt cancelled), although the job succeeded under that very lease."""
    _run(conn)
    (a,) = claim_next(conn, "A", now=at(0), lease_s=10)
    assert jobq.complete(conn, a.lease, result="done", now=at(1)) is not None
    assert jobq.heartbeat(conn, worker="A", leases=[a.lease], lease_s=10, now=at(2)) == {}
    # A takeover's completion is still a lost lease for the stale owner.
    _other = accept(conn, owner_id="owner-1", request_key="req-2", kind="work", body={})
    (b,) = claim_next(conn, "A", now=at(3), lease_s=10)
    (b2,) = claim_next(conn, "B", now=at(14), lease_s=10)
    assert jobq.complete(conn, b2.lease, result="B's", now=at(15)) is not None
    assert jobq.heartbeat(conn, worker="A", leases=[b.lease], lease_s=10, now=at(15)) == {b.id: "succeeded"}


def test_completions_in_one_statement_are_fenced_one_by_one(conn):
    for key in ("r1", "r2", "r3"):
        accept(conn, owner_id="owner-1", request_key=key, kind="work", body={})
    a1, a2, a3 = jobq.claim(conn, worker="A", takes=[Take("interactive", "owner-1", 3, jobq.NO_OWNER_LIMIT)],
                            lease_s=10, now=at(0))
    (b1,) = claim_next(conn, "B", now=at(10.5), lease_s=10)  # every lease expired; B takes a1 over
    assert b1.id == a1.id
    done = [jobq.Done(a.id, a.token, '"ok"') for a in (a1, a2, a3)]
    assert jobq.complete_many(conn, worker="A", done=done, now=at(11)) == {}  # every lease ran out
    (b2,) = claim_next(conn, "B", now=at(11), lease_s=10)
    facts = jobq.complete_many(conn, worker="B", done=[jobq.Done(b1.id, b1.token, '{"n": 1}'),
                                                         jobq.Done(b2.id, b2.token + 1, '"stale"')],
                               now=at(12))
    assert list(facts) == [b1.id] and facts[b1.id].attempts == 2
    assert rows(conn.info.dsn, "SELECT id, status, result FROM jobs ORDER BY id") == [
        (a1.id, "succeeded", {"n": 1}), (a2.id, "running", None), (a3.id, "queued", None)]
