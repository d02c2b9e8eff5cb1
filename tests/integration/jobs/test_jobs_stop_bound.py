"""A pool whose database stops answering: its connections' TCP settings, and a stop() whose
time is known in advance.

The fault proxy (tests/fixtures/proxy.py) has two faults for this: ``cut()`` resets the
connections (a statement fails at once), ``blackhole()`` keeps them open and forwards
nothing (a partition).  Its blackhole holds the bytes in the proxy, whose kernel still
acknowledges them and answers keep-alive probes: TCP timeouts never fire through it, so
what bounds stop() here is stop() itself.  A partition that drops packets, where the
keep-alives and ``tcp_user_timeout`` end a statement, is tests/faults/test_jobs_packet_loss.py.

Before: the pool's connections had no keep-alives and no ``tcp_user_timeout``, and
stop() waited for its threads one after the other (the dispatcher 30 s, then the others
5 s each): 46 s behind a partition (an audit of the pool).
"""

from __future__ import annotations

import gc
import os
import socket
import threading
import time
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from consumer_sdk.jobs import JobsMetrics, NewJob, WorkerConfig, WorkerPool, enqueue
from consumer_sdk.jobs.worker import STOP_GRACE_S
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import recording_logger, rows

#: What stop() may take beyond its bound: the scheduler, the last joins.
SLACK_S = 0.75
NAME = "t-keepalives"


def _options(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """The TCP settings the kernel holds for the connection's socket."""
    with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
        return {"keepalive": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                "idle": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                "interval": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                "count": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
                "user_timeout_ms": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)}


def _open_connections(application_name: str) -> list[psycopg.Connection[Any]]:
    """This process's open connections of that application_name (the pool's, whatever made them)."""
    return [c for c in gc.get_objects() if isinstance(c, psycopg.Connection) and not c.closed
            and c.info.parameter_status("application_name") == application_name]


@pytest.mark.parametrize(("dsn_options", "expected"), [
    # lease 6 s, heartbeat 3 s: probes after 3 s idle, every second; 6 s unacknowledged ends it
    ({}, {"keepalive": 1, "idle": 3, "interval": 1, "count": 3, "user_timeout_ms": 6000}),
    # the DSN's own values win, the rest still derived
    ({"keepalives_idle": "7", "tcp_user_timeout": "12345"},
     {"keepalive": 1, "idle": 7, "interval": 1, "count": 3, "user_timeout_ms": 12345}),
])
def test_every_connection_of_a_pool_carries_keepalives_and_a_user_timeout(
        conn, jobs_db, dsn_options: dict[str, str], expected: dict[str, int]) -> None:
    both = threading.Barrier(3)

    def held(ctx: Any) -> None:
        both.wait(20)  # two jobs running at once: both executors connected
        both.wait(20)

    dsn = make_conninfo(jobs_db, host="127.0.0.1", **dsn_options)
    pool = WorkerPool(WorkerConfig(dsn=dsn, max_concurrency=2, lease_duration_s=6.0, heartbeat_interval_s=3.0,
                                   poll_interval_s=0.2, application_name=NAME), {"held": held})
    pool.start()
    try:
        enqueue(conn, [NewJob(owner_id=f"o{i}", queue="bulk", kind="held", payload={}) for i in range(2)])
        both.wait(20)
        wait_until(lambda: pool.listening and pool.heartbeat_once() == 0 and len(_open_connections(NAME)) >= 5,
                   timeout_s=10, message=lambda: f"{len(_open_connections(NAME))} connections")
        # The dispatcher's, the heartbeat's, two executors', the listener's: as the server sees them.
        assert rows(jobs_db, "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (NAME,)) == [(5,)]
        assert [_options(c) for c in _open_connections(NAME)] == [expected] * 5
        both.wait(20)
    finally:
        pool.stop(drain_timeout_s=2.0)


@pytest.mark.parametrize("handler_listens", [True, False], ids=["handler_cancellable", "handler_deaf"])
def test_stop_returns_within_its_bound_when_the_database_stops_answering(conn, jobs_db, tcp_proxy,
                                                                         handler_listens: bool) -> None:
    info = conninfo_to_dict(jobs_db)
    proxy = tcp_proxy(str(info.get("host") or "127.0.0.1"), int(str(info["port"])))
    started, release = threading.Event(), threading.Event()

    def work(ctx: Any) -> str:
        started.set()
        if not handler_listens:  # ignores its cancellation: stop() must not wait for it either
            release.wait(30)
            return "late"
        while not release.is_set():
            ctx.sleep(0.05)  # raises LeaseLost once cancelled
        return "ok"

    logged: list[dict[str, Any]] = []

    drain_s = 1.0
    pool = WorkerPool(WorkerConfig(dsn=make_conninfo(jobs_db, host="127.0.0.1", port=str(proxy.port)),
                                   max_concurrency=2, lease_duration_s=3.0, poll_interval_s=0.1,
                                   reconcile_interval_s=0.5, drain_timeout_s=drain_s),
                      {"work": work}, metrics=JobsMetrics(), log=recording_logger(logged))
    before = set(threading.enumerate())
    pool.start()
    try:
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="work", payload={})])
        assert started.wait(20)
        wait_until(lambda: pool.listening, timeout_s=10, message="listening")
        proxy.blackhole()
        time.sleep(1.2)  # noqa: TID251 - the heartbeat (every second) and the dispatcher's rounds now wait on it
        stopping = threading.Thread(target=pool.stop, name="t-stop")
        began = time.monotonic()
        stopping.start()
        stopping.join(drain_s + STOP_GRACE_S + SLACK_S)
        took = time.monotonic() - began
        assert not stopping.is_alive(), f"stop() still running after {took:.1f} s"
        assert took <= drain_s + STOP_GRACE_S + SLACK_S
        assert "pool_stop_abandoned" in [e["event"] for e in logged], logged
        # Their connections shut down, the threads that waited on them end at once (the
        # handler that ignores its cancellation ends when it returns).
        release.set()
        wait_until(lambda: not _pool_threads(before), timeout_s=3, message=lambda: str(_pool_threads(before)))
    finally:
        release.set()
        proxy.restore()
        stopping_left = [t for t in threading.enumerate() if t.name == "t-stop"]
        for thread in stopping_left:
            thread.join(60)
    assert rows(jobs_db, "SELECT status FROM jobs") in ([("running",)], [("queued",)])  # left to its lease


def _pool_threads(before: set[threading.Thread]) -> list[str]:
    """The pool's threads still alive (started after ``before``; the fence keep-alives' pool ends
    with its last task)."""
    return [t.name for t in threading.enumerate() if t not in before and t.name.startswith("jobs-")
            and not t.name.startswith("jobs-fence-keepalive")]
