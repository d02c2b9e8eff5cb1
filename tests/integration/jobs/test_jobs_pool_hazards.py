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
