"""Issue 19: ``JobContext.fenced_execute``, a one-statement fenced write in one round trip
(BEGIN, migration 0012's raising fence, the statement and COMMIT in one libpq pipeline),
on the real database: what it writes, what it refuses, what it leaves behind, and its
fallbacks (no migration 0012, no pipeline mode, the prepared fence gone)."""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.pq import PipelineStatus, TransactionStatus
from psycopg.types.json import Jsonb

from consumer_sdk.jobs import LeaseLost, NewJob, enqueue, fenced
from consumer_sdk.jobs import queue as jobq
from consumer_sdk.jobs._db import q
from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.model import ClaimedJob, Take
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import at, claim_next, rows
from tests.integration.sdk._support import RoundTrips

INSERT = "INSERT INTO effects (job_id, token, step) VALUES (%(id)s, %(token)s, %(step)s)"


def _claim(conn: psycopg.Connection[Any], *, now: dt.datetime | None = None, lease_s: float = 10,
           worker: str = "A") -> ClaimedJob:
    (job,) = jobq.claim(conn, worker=worker, takes=[Take(queue="interactive", owner_id="o1", n=1,
                                                          owner_limit=jobq.NO_OWNER_LIMIT)],
                        lease_s=lease_s, now=now)
    return job


def _job(conn: psycopg.Connection[Any], **claim: Any) -> ClaimedJob:
    enqueue(conn, [NewJob(owner_id="o1", queue="interactive", kind="work", payload={})])
    return _claim(conn, **claim)


def _idle(conn: psycopg.Connection[Any]) -> bool:
    return (conn.info.transaction_status == TransactionStatus.IDLE
            and conn.pgconn.pipeline_status == PipelineStatus.OFF)


def test_a_fenced_write_costs_one_round_trip_and_commits(conn, jobs_db):
    job = _job(conn, lease_s=60)  # the database's clock, as in production
    ctx = JobContext(job, conn, deadline=float("inf"))
    with RoundTrips(conn) as first:  # prepares the fence: once per connection
        assert ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 1}) == 1
    assert first.count == 2 and any("PREPARE" in text for text in first.sent), first.sent
    with RoundTrips(conn) as trips:
        assert ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 2}) == 1
    assert trips.count == 1, trips.sent
    assert _idle(conn)
    # Committed: another session sees both rows.
    assert rows(jobs_db, "SELECT step, token FROM effects ORDER BY step") == [(1, job.token), (2, job.token)]
    # The row count is the statement's.
    assert ctx.fenced_execute("UPDATE effects SET worker = %s WHERE job_id = %s", ("A", job.id)) == 2


def test_a_lost_lease_writes_nothing_and_raises_lease_lost(conn, jobs_db):
    job = _job(conn, now=at(0), lease_s=10)
    ctx = JobContext(job, conn, deadline=float("inf"), db_now=lambda: at(5))
    ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 1})

    late = JobContext(job, conn, deadline=float("inf"), db_now=lambda: at(10.5))  # ran out, not taken
    with pytest.raises(LeaseLost, match=f"job {job.id}"):
        late.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 2})
    assert late.cancelled and late.cancel_reason == "lease_lost"
    assert _idle(conn)

    (taker,) = claim_next(conn, "B", now=at(11), lease_s=10)  # reaped and taken over: a new token
    assert (taker.id, taker.token) == (job.id, job.token + 1)
    stale = JobContext(job, conn, deadline=float("inf"), db_now=lambda: at(12))
    with pytest.raises(LeaseLost):
        stale.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 3})
    with pytest.raises(LeaseLost):  # a cancelled context refuses before sending anything
        stale.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 4})
    current = JobContext(taker, conn, deadline=float("inf"), db_now=lambda: at(12))
    current.fenced_execute(INSERT, {"id": taker.id, "token": taker.token, "step": 5})
    assert _idle(conn)
    assert rows(jobs_db, "SELECT step, token FROM effects ORDER BY step") == [(1, job.token), (5, taker.token)]


def test_the_statements_own_error_is_raised_and_nothing_is_written(conn, jobs_db):
    job = _job(conn, lease_s=60)
    ctx = JobContext(job, conn, deadline=float("inf"))
    conn.execute("CREATE UNIQUE INDEX effects_once ON effects (job_id, step)")
    ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 1})
    with pytest.raises(psycopg.errors.UniqueViolation):
        ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 1})
    with pytest.raises(psycopg.errors.UndefinedTable):
        ctx.fenced_execute("INSERT INTO no_such_table VALUES (%s)", (1,))
    with pytest.raises(psycopg.errors.SyntaxError):  # one statement only: a CTE writes several
        ctx.fenced_execute("INSERT INTO effects (job_id, token, step) VALUES (1, 1, 7); SELECT 1")
    assert not ctx.cancelled and _idle(conn)
    # A deferred constraint fails at COMMIT: its error too, and nothing is written.
    conn.execute("ALTER TABLE effects ADD CONSTRAINT effects_small CHECK (step < 100)")
    conn.execute("CREATE TABLE effects_parent (step int PRIMARY KEY)")
    conn.execute("ALTER TABLE effects ADD CONSTRAINT effects_step_fk FOREIGN KEY (step) "
                 "REFERENCES effects_parent (step) DEFERRABLE INITIALLY DEFERRED NOT VALID")
    with pytest.raises(psycopg.errors.ForeignKeyViolation):
        ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 3})
    assert not ctx.cancelled and _idle(conn)
    conn.execute("INSERT INTO effects_parent VALUES (4)")
    assert ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 4}) == 1
    assert rows(jobs_db, "SELECT step FROM effects ORDER BY step") == [(1,), (4,)]


def test_values_are_bound_as_a_cursor_binds_them(conn, jobs_db):
    """Server-side parameters through psycopg's own adapters: the same values as
    ``conn.execute`` would store, whatever the placeholder style or composition."""
    job = _job(conn, lease_s=60)
    ctx = JobContext(job, conn, deadline=float("inf"))
    conn.execute("CREATE TABLE kinds (n bigint, s text, b bytea, j jsonb, t timestamptz, x numeric, nothing text)")
    when = dt.datetime(2030, 5, 6, 7, 8, 9, 123456, tzinfo=dt.UTC)
    values = (2**40, "it's %s; -- \u00e9", b"\x00\xff'", Jsonb({"a": [1, "b"]}), when, 1.5, None)
    ctx.fenced_execute("INSERT INTO kinds VALUES (%s, %s, %s, %s, %s, %s, %s)", values)
    ctx.fenced_execute(sql.SQL("INSERT INTO {} (n, s) VALUES (%(n)s, %(s)s)").format(sql.Identifier("kinds")),
                       {"n": 3, "s": "named"})
    ctx.fenced_execute("UPDATE kinds SET x = x * 2 WHERE n = 1099511627776")  # no parameters at all
    assert rows(jobs_db, "SELECT n, s, b, j, t, x::text, nothing FROM kinds ORDER BY n") == [
        (3, "named", None, None, None, None, None),
        (2**40, "it's %s; -- \u00e9", b"\x00\xff'", {"a": [1, "b"]}, when, "3.0", None),
    ]


def test_inside_an_open_fenced_transaction_it_runs_in_that_transaction(conn, jobs_db):
    job = _job(conn, lease_s=60)
    ctx = JobContext(job, conn, deadline=float("inf"))
    with pytest.raises(RuntimeError, match="changed my mind"), ctx.fenced_transaction():
        assert ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 1}) == 1
        raise RuntimeError("changed my mind")
    assert rows(jobs_db, "SELECT count(*) FROM effects") == [(0,)]
    with ctx.fenced_transaction():
        ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 2})
        ctx.put_result("page", {"done": 2})
    assert rows(jobs_db, "SELECT step FROM effects") == [(2,)]
    assert rows(jobs_db, "SELECT key, value FROM job_results") == [("page", {"done": 2})]


def test_put_result_outside_a_transaction_is_one_round_trip(conn, jobs_db):
    job = _job(conn, now=at(0), lease_s=10)
    ctx = JobContext(job, conn, deadline=float("inf"), db_now=lambda: at(1))
    ctx.put_result("page-1", "first")
    with RoundTrips(conn) as trips:
        ctx.put_result("page-1", "again")  # by key: overwritten
    assert trips.count == 1, trips.sent
    late = JobContext(job, conn, deadline=float("inf"), db_now=lambda: at(11))
    with pytest.raises(LeaseLost):
        late.put_result("page-1", "too late")
    assert rows(jobs_db, "SELECT key, value, lease_token FROM job_results") == [("page-1", "again", job.token)]


def test_the_fence_blocks_a_takeover_until_the_commit_and_waits_for_one(conn, jobs_db):
    """The raising fence takes the same FOR KEY SHARE lock as fenced_transaction's: a
    takeover's FOR UPDATE held elsewhere makes the write wait (here: past lock_timeout,
    the server's error, nothing written, the connection usable)."""
    job = _job(conn, lease_s=60)
    ctx = JobContext(job, conn, deadline=float("inf"))
    ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 1})  # prepared
    conn.execute("SET lock_timeout = '50ms'")
    with psycopg.connect(jobs_db) as other:
        other.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (job.id,))
        with pytest.raises(psycopg.errors.LockNotAvailable):
            ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 2})
    assert _idle(conn) and not ctx.cancelled
    conn.execute("RESET lock_timeout")
    # And the other way round: while the write's statement runs, the row is locked against
    # a takeover's FOR UPDATE.
    done = threading.Event()

    def slow_write() -> None:
        with psycopg.connect(jobs_db, autocommit=True) as mine:
            mine.execute("SET application_name = 'slow_fenced_write'")
            slow = JobContext(job, mine, deadline=float("inf"))
            slow.fenced_execute("INSERT INTO effects (job_id, token, step) "
                                "SELECT %s, %s, 3 FROM pg_sleep(1)", (job.id, job.token))
            done.set()

    writer = threading.Thread(target=slow_write)
    writer.start()
    try:
        wait_until(lambda: rows(jobs_db, "SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                                         "'slow_fenced_write' AND wait_event = 'PgSleep'") == [(1,)],
                   timeout_s=10)
        with psycopg.connect(jobs_db) as other, pytest.raises(psycopg.errors.LockNotAvailable):
            other.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE NOWAIT", (job.id,))
    finally:
        writer.join(10)
    assert done.is_set()
    assert rows(jobs_db, "SELECT step, token FROM effects ORDER BY step") == [(1, job.token), (3, job.token)]


def test_without_migration_0012_it_falls_back_to_a_fenced_transaction(conn, jobs_db):
    conn.execute("DROP FUNCTION outbox_jobs_fence(bigint, bigint, timestamptz)")
    job = _job(conn, now=at(0), lease_s=10)
    ctx = JobContext(job, conn, deadline=float("inf"), db_now=lambda: at(1))
    assert ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 1}) == 1
    with RoundTrips(conn) as trips:
        ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 2})
    assert trips.count == 3, trips.sent  # BEGIN with the fence, the statement, COMMIT
    late = JobContext(job, conn, deadline=float("inf"), db_now=lambda: at(11))
    with pytest.raises(LeaseLost):
        late.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 3})
    assert _idle(conn)
    assert rows(jobs_db, "SELECT step FROM effects ORDER BY step") == [(1,), (2,)]


def test_without_pipeline_mode_it_falls_back_to_a_fenced_transaction(conn, jobs_db, monkeypatch):
    monkeypatch.setattr(psycopg.capabilities, "has_pipeline", lambda check=False: False)
    job = _job(conn, now=at(0), lease_s=10)
    ctx = JobContext(job, conn, deadline=float("inf"), db_now=lambda: at(1))
    assert ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 1}) == 1
    late = JobContext(job, conn, deadline=float("inf"), db_now=lambda: at(11))
    with pytest.raises(LeaseLost):
        late.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 2})
    assert _idle(conn)
    assert rows(jobs_db, "SELECT step FROM effects") == [(1,)]


def test_a_prepared_fence_that_vanished_is_prepared_again(conn, jobs_db):
    job = _job(conn, lease_s=60)
    ctx = JobContext(job, conn, deadline=float("inf"))
    ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 1})
    conn.execute("DEALLOCATE ALL")  # DISCARD ALL, or a pooler's other server session
    with RoundTrips(conn) as trips:
        assert ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 2}) == 1
    # The refused pipeline, its ROLLBACK, the PREPARE, the pipeline again.
    assert trips.count == 4 and any("PREPARE" in text for text in trips.sent), trips.sent
    assert _idle(conn) and not ctx.cancelled
    assert rows(jobs_db, "SELECT step FROM effects ORDER BY step") == [(1,), (2,)]


def test_a_broken_connection_is_a_lost_lease(conn, jobs_db):
    job = _job(conn, lease_s=60)
    with psycopg.connect(jobs_db, autocommit=True) as mine:
        ctx = JobContext(job, mine, deadline=float("inf"))
        ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 1})
        pid = mine.info.backend_pid
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(LeaseLost, match="lease"):
            ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 2})
        assert ctx.cancelled
    assert rows(jobs_db, "SELECT step FROM effects") == [(1,)]


def test_the_raising_fence_is_the_one_jobs_sql_prepares():
    assert q("fence_raise_prepare").startswith(f"PREPARE {fenced.RAISING_FENCE_STATEMENT.decode()} (")


def test_a_fence_that_never_stays_prepared_is_given_up_for_fenced_transactions(conn, jobs_db, monkeypatch):
    """A pooler that moves sessions between servers loses the prepared fence each time:
    after PREPARED_LOSSES_MAX losses in a row the connection takes the three round trips
    for good, every write still fenced and committed once."""
    job = _job(conn, lease_s=60)
    ctx = JobContext(job, conn, deadline=float("inf"))
    real_send_all = fenced._wire.send_all

    def another_server(c, steps):  # type: ignore[no-untyped-def]
        if c.info.transaction_status == TransactionStatus.IDLE:  # a pooler moves sessions between transactions
            c.execute("DEALLOCATE ALL")  # what the next server session would not have
        return real_send_all(c, steps)

    monkeypatch.setattr(fenced._wire, "send_all", another_server)
    for step in range(1, 4):
        assert ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": step}) == 1
        assert _idle(conn)
    monkeypatch.setattr(fenced._wire, "send_all", real_send_all)
    with RoundTrips(conn) as trips:
        ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 4})
    # fenced_transaction's way: BEGIN with its own fence, the statement, COMMIT (and its
    # fence prepared again first: the DEALLOCATEs took it too).
    assert not any("outbox_jobs_fence_v3" in text for text in trips.sent), trips.sent
    assert trips.count == 4 and "outbox_jobs_fence_v2" in trips.sent[0], trips.sent
    assert rows(jobs_db, "SELECT step FROM effects ORDER BY step") == [(1,), (2,), (3,), (4,)]
    late = JobContext(job, conn, deadline=float("inf"), db_now=lambda: at(10**9))
    with pytest.raises(LeaseLost):
        late.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 5})
    assert rows(jobs_db, "SELECT count(*) FROM effects") == [(4,)]


def test_a_closed_connection_is_not_kept_alive_by_the_one_trip_path(conn, jobs_db):
    """What fenced_execute remembers about a connection (prepared fence, losses, the
    statement's binding) does not keep it alive once the pool drops it."""
    import gc
    import weakref

    job = _job(conn, lease_s=60)
    mine = psycopg.connect(jobs_db, autocommit=True)
    ctx = JobContext(job, mine, deadline=float("inf"))
    ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 1})
    assert mine in fenced._RAISING_FENCE_PREPARED
    gone = weakref.ref(mine)
    mine.close()
    del ctx, mine
    gc.collect()
    assert gone() is None


def test_several_statements_go_in_one_round_trip_and_commit_together(conn, jobs_db):
    job = _job(conn, lease_s=60)
    ctx = JobContext(job, conn, deadline=float("inf"))
    ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 0})  # prepares the fence
    statements = [(INSERT, {"id": job.id, "token": job.token, "step": 1}),
                  ("UPDATE effects SET step = step + 10 WHERE job_id = %s AND step < 2", (job.id,)),
                  (INSERT, {"id": job.id, "token": job.token, "step": 3})]
    with RoundTrips(conn) as trips:
        assert ctx.fenced_statements(statements) == [1, 2, 1]  # each one's row count
    assert trips.count == 1, trips.sent
    assert _idle(conn)
    assert rows(jobs_db, "SELECT step FROM effects ORDER BY step") == [(3,), (10,), (11,)]


def test_several_statements_write_nothing_when_one_fails_or_the_lease_is_lost(conn, jobs_db):
    job = _job(conn, now=at(0), lease_s=10)
    ctx = JobContext(job, conn, deadline=float("inf"), db_now=lambda: at(1))
    with pytest.raises(psycopg.errors.UndefinedTable):
        ctx.fenced_statements([(INSERT, {"id": job.id, "token": job.token, "step": 1}),
                               ("INSERT INTO no_such_table VALUES (%s)", (1,))])
    assert not ctx.cancelled and _idle(conn)
    late = JobContext(job, conn, deadline=float("inf"), db_now=lambda: at(11))
    with pytest.raises(LeaseLost):
        late.fenced_statements([(INSERT, {"id": job.id, "token": job.token, "step": 2}),
                                (INSERT, {"id": job.id, "token": job.token, "step": 3})])
    assert late.cancelled and _idle(conn)
    assert rows(jobs_db, "SELECT step FROM effects") == []


def test_several_statements_without_migration_0012_go_in_a_fenced_transaction(conn, jobs_db):
    conn.execute("DROP FUNCTION outbox_jobs_fence(bigint, bigint, timestamptz)")
    job = _job(conn, now=at(0), lease_s=10)
    ctx = JobContext(job, conn, deadline=float("inf"), db_now=lambda: at(1))
    ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 0})  # learns there is no 0012
    with RoundTrips(conn) as trips:
        assert ctx.fenced_statements([(INSERT, {"id": job.id, "token": job.token, "step": 1}),
                                      (INSERT, {"id": job.id, "token": job.token, "step": 2})]) == [1, 1]
    assert trips.count == 4, trips.sent  # BEGIN with the fence, each statement, COMMIT
    with ctx.fenced_transaction():  # inside an open fenced transaction: in that transaction
        assert ctx.fenced_statements([(INSERT, {"id": job.id, "token": job.token, "step": 3})]) == [1]
    assert rows(jobs_db, "SELECT step FROM effects ORDER BY step") == [(0,), (1,), (2,), (3,)]


def test_a_failed_write_keeps_the_prepared_fence_when_psycopg_holds_prepared_statements(conn, jobs_db):
    """A worker connection runs its claims often enough for psycopg to prepare them.  A failed
    one-trip write was then rolled back with psycopg's rollback(), which answers with DEALLOCATE
    ALL when psycopg holds prepared statements: the prepared fence went along, the next write
    prepared it again (a round trip more, a loss counted), and after PREPARED_LOSSES_MAX
    failed writes in a row the connection left the one trip for good.  Now the rollback goes
    below psycopg and the fence stays."""
    job = _job(conn, lease_s=60)
    ctx = JobContext(job, conn, deadline=float("inf"))
    for _ in range(6):  # psycopg prepares a statement it ran five times
        conn.execute("SELECT count(*) FROM jobs WHERE id = %s", (job.id,))
    assert ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 1}) == 1

    def prepared() -> set[str]:
        return {name for (name,) in conn.execute("SELECT name FROM pg_prepared_statements")}

    assert fenced.RAISING_FENCE_STATEMENT.decode() in prepared()
    assert any(name.startswith("_pg3_") for name in prepared())  # psycopg's own
    for _ in range(fenced.PREPARED_LOSSES_MAX + 1):  # a poison write, retried on this connection
        with pytest.raises(psycopg.errors.UndefinedTable):
            ctx.fenced_execute("INSERT INTO no_such_table VALUES (%s)", (1,))
        assert fenced.RAISING_FENCE_STATEMENT.decode() in prepared()
    with RoundTrips(conn) as trips:
        assert ctx.fenced_execute(INSERT, {"id": job.id, "token": job.token, "step": 2}) == 1
    assert trips.count == 1, trips.sent  # still the one trip, the fence not prepared again
    assert fenced.one_trip_fence(conn) and _idle(conn)
