"""A worker pool against handlers and networks that misbehave (an audit of the pool).

Each test failed on the code before: a handler raising a BaseException ended an executor
thread and its jobs stayed running; an error whose message PostgreSQL cannot store made
every attempt's write fail, the job waiting out its lease each time and dead-lettered as
``lease_expired``; a partition that drops packets kept the heartbeat's statement waiting
and the handlers running while another worker had their jobs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from consumer_sdk.jobs import Backoff, LeaseLost, NewJob, enqueue
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import rows

FAST = {"backoff": Backoff(initial_s=0.05, max_s=0.1), "poll_interval_s": 0.1, "reconcile_interval_s": 0.5}


def _dead_letters(dsn: str) -> dict[str, tuple[Any, ...]]:
    found = rows(dsn, "SELECT j.kind, d.reason, d.error_type, d.error, d.attempts FROM job_dead_letters d "
                      "JOIN jobs j ON j.id = d.job_id")
    return {r[0]: r[1:] for r in found}


class Hostile(BaseException):
    pass


def test_a_handler_raising_a_base_exception_fails_its_attempt_and_the_pool_runs_on(conn, jobs_db, pools):
    raised = {"interrupt": KeyboardInterrupt, "exit": SystemExit, "cancelled": asyncio.CancelledError,
              "hostile": Hostile}

    def raiser(kind: str):
        def handler(ctx: Any) -> None:
            raise raised[kind]("from the handler")
        return handler

    handlers: dict[str, Any] = {kind: raiser(kind) for kind in raised}
    handlers["ok"] = lambda ctx: "done"
    pools(handlers, max_concurrency=2, lease_duration_s=30.0, **FAST)
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind=kind, payload={}, max_attempts=2) for kind in raised])
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={}) for _ in range(10)])
    # Within seconds, not a 30 s lease: each attempt's failure is written at once.
    wait_until(lambda: len(_dead_letters(jobs_db)) == len(raised), timeout_s=20,
               message=lambda: f"dead letters {_dead_letters(jobs_db)}")
    wait_until(lambda: rows(jobs_db, "SELECT count(*) FROM jobs WHERE kind = 'ok' AND status = 'succeeded'")
               == [(10,)], timeout_s=20, message="the other jobs done")
    for kind, cls in raised.items():
        reason, error_type, error, attempts = _dead_letters(jobs_db)[kind]
        assert (reason, error_type, attempts) == ("attempts_exhausted", cls.__name__, 2), (kind, error)
        assert error == f"{cls.__name__}: from the handler"
    assert len([t for t in threading.enumerate() if t.name.startswith("jobs-exec")]) == 2


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message for you")


def test_errors_postgresql_cannot_store_are_dead_lettered_readably(conn, jobs_db, pools):
    errors = {"unprintable": Unprintable(), "nul": ValueError("a\x00b"),
              "surrogates": ValueError(b"caf\xe9".decode("utf-8", "surrogateescape"))}

    def raiser(kind: str):
        def handler(ctx: Any) -> None:
            raise errors[kind]
        return handler

    pools({kind: raiser(kind) for kind in errors}, max_concurrency=2, lease_duration_s=30.0, **FAST)
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind=kind, payload={}, max_attempts=2) for kind in errors])
    wait_until(lambda: len(_dead_letters(jobs_db)) == len(errors), timeout_s=20,
               message=lambda: f"dead letters {_dead_letters(jobs_db)}")
    found = _dead_letters(jobs_db)
    assert found["unprintable"][:3] == ("attempts_exhausted", "Unprintable",
                                        "Unprintable: <its message could not be formatted: RuntimeError>")
    assert found["nul"][:3] == ("attempts_exhausted", "ValueError", "ValueError: a\\x00b")
    assert found["surrogates"][:3] == ("attempts_exhausted", "ValueError", "ValueError: caf\\udce9")


def test_a_partition_that_drops_packets_cancels_the_handlers_at_their_deadline(conn, jobs_db, pools, tcp_proxy):
    info = conninfo_to_dict(jobs_db)
    proxy = tcp_proxy(str(info.get("host") or "127.0.0.1"), int(str(info["port"])))
    events: list[tuple[str, float]] = []
    started = threading.Event()

    def work(ctx: Any) -> str:
        started.set()
        try:
            for _ in range(300):
                ctx.sleep(0.1)
        except LeaseLost as exc:
            events.append((exc.reason, time.monotonic()))
            raise
        events.append(("finished", time.monotonic()))
        return "ok"

    pools({"work": work}, dsn=make_conninfo(jobs_db, host="127.0.0.1", port=str(proxy.port)),
          max_concurrency=1, lease_duration_s=3.0, drain_timeout_s=0.5, **FAST)
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="work", payload={})])
    assert started.wait(20)
    proxy.blackhole()
    cut_at = time.monotonic()
    # The lease is 3 s: the handler is told at its local deadline (3 s less a margin after
    # its last renewal), not when TCP gives up on the heartbeat's statement.
    wait_until(lambda: events, timeout_s=10, message="the handler cancelled")
    reason, at = events[0]
    assert reason == "lease_unconfirmed"
    assert at - cut_at < 3.5
    proxy.restore()


def test_large_results_finishing_together_are_written_and_the_pool_claims_on(conn, jobs_db, pools):
    # Two results of 140 MB, each storable: written in one round's statement, whose jsonb
    # array of completions PostgreSQL caps at 256 MB, they failed it at every round, read
    # as "database unavailable", and nothing was claimed again (an audit of the pool).
    both = threading.Barrier(2)

    def big(ctx: Any) -> str:
        both.wait(20)
        return "x" * 140_000_000

    pools({"big": big, "small": lambda ctx: "ok"}, max_concurrency=2, lease_duration_s=60.0, **FAST)
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="big", payload={}) for _ in range(2)])
    wait_until(lambda: rows(jobs_db, "SELECT count(*) FROM jobs WHERE status = 'succeeded'") == [(2,)],
               timeout_s=60, message=lambda: str(rows(jobs_db, "SELECT id, status, attempts FROM jobs")))
    assert rows(jobs_db, "SELECT octet_length(result::text) FROM jobs") == [(140_000_002,), (140_000_002,)]
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="small", payload={}) for _ in range(5)])
    wait_until(lambda: rows(jobs_db, "SELECT count(*) FROM jobs WHERE status = 'succeeded'") == [(7,)],
               timeout_s=20, message="the small jobs done after them")


def test_a_result_the_database_refuses_for_its_size_fails_the_job_with_the_reason(conn, jobs_db, pools):
    # A result over jsonb's 256 MB limit: PostgreSQL's program_limit_exceeded (54000), read
    # as "database unavailable", left the job to its lease attempt after attempt.  The
    # limit is raised here by a trigger with that SQLSTATE, for a result of 34 MB (too large
    # for a round's statement too: written alone).
    conn.execute("""
        CREATE FUNCTION refuse_large_result() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'total size of jsonb array elements exceeds the maximum of 268435455 bytes'
                USING ERRCODE = '54000';
        END $$;
        CREATE TRIGGER refuse_large_result BEFORE UPDATE OF result ON jobs FOR EACH ROW
            WHEN (octet_length(NEW.result::text) > 34000000) EXECUTE FUNCTION refuse_large_result();
    """)
    pools({"big": lambda ctx: "x" * 34_000_001}, max_concurrency=1, lease_duration_s=60.0, **FAST)
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="big", payload={}, max_attempts=5)])
    wait_until(lambda: "big" in _dead_letters(jobs_db), timeout_s=20, message="the job dead-lettered")
    reason, error_type, error, attempts = _dead_letters(jobs_db)["big"]
    assert (reason, error_type, attempts) == ("permanent_error", "InvalidJob", 1)
    assert "exceeds the maximum of 268435455 bytes" in error


def test_a_handler_that_spoils_its_session_spoils_no_other_job(conn, jobs_db, pools):
    # A handler's SET search_path stayed on the executor's connection: every later job
    # there failed its writes and waited out its lease, and was dead-lettered as
    # lease_expired (an audit of the pool).  A connection whose write failed is not reused.
    def poison(ctx: Any) -> str:
        ctx.conn.execute("SET search_path TO pg_catalog")
        return "ok"

    def fails(ctx: Any) -> None:
        raise RuntimeError("transient")

    def ok(ctx: Any) -> str:
        ctx.put_result("r", 1)
        return "ok"

    pools({"poison": poison, "fails": fails, "ok": ok}, max_concurrency=1, lease_duration_s=2.0, **FAST)
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="poison", payload={})])
    wait_until(lambda: rows(jobs_db, "SELECT status FROM jobs") == [("succeeded",)], timeout_s=10,
               message="the poisoning job done")
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="fails", payload={}, max_attempts=3)])
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={}) for _ in range(3)])
    wait_until(lambda: rows(jobs_db, "SELECT count(*) FROM jobs WHERE status IN ('succeeded', 'failed')")
               == [(5,)], timeout_s=30, message=lambda: str(rows(jobs_db, "SELECT kind, status, attempts FROM jobs")))
    assert rows(jobs_db, "SELECT kind, status FROM jobs WHERE kind = 'ok'") == [("ok", "succeeded")] * 3
    assert _dead_letters(jobs_db)["fails"][:2] == ("attempts_exhausted", "RuntimeError")
