"""A worker pool whose database stops answering without a word (a partition that drops packets,
no RST): its dispatcher's round hangs instead of failing.  What its health, its log and its
gauge say, on a real PostgreSQL.

The pool reaches PostgreSQL through the fault proxy; ``blackhole()`` keeps every connection
open and forwards nothing, and the proxy's kernel keeps acknowledging what the pool sends:
the round's statement waits for as long as the blackhole lasts (TCP never gives up through
it), as a partition's does until ``tcp_user_timeout`` (one lease: 30 s by default, often
minutes in production).  ``restore()`` delivers what was held.

The pool said ready all along and logged nothing (the round neither passed nor failed): a
readiness probe kept routing work to a pool that could claim nothing.  Now it is not ready
once the round has been in flight for ``UNANSWERED_S``, says why, logs it once and its end
once, the gauge ``outbox_jobs_database_unavailable`` is 1 meanwhile, and every job runs once
when the network is back.

In a real partition (a veth pair whose ends drop every packet, as in
``test_jobs_packet_loss.py``: needs root) TCP does give up, one lease later
(``tcp_user_timeout``): the round then fails, and the pool stays not ready through that
failure and the reconnects that follow, without a moment back to ready.

A lock wait is not that: the pool's lock-wait watch names it (``jobs_lock_wait``) and the pool
stays ready through it (:mod:`consumer_sdk.jobs.outage` says why).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from consumer_sdk.jobs import JobsMetrics, NewJob, WorkerConfig, WorkerPool, enqueue
from tests.faults.test_jobs_packet_loss import veth_link
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import migrate_jobs_db, recording_logger, rows

GAUGE = "outbox_jobs_database_unavailable"
#: consumer_sdk.jobs.outage.UNANSWERED_S (tests/unit/jobs/test_jobs_unanswered_rules.py checks they agree).
UNANSWERED_S = 10.0
HEADLINE = "the database has not answered the dispatcher for "


@pytest.fixture
def jobs_db(db_dsn: str) -> str:  # as the other jobs fault tests: the jobs schema, a fresh database
    return migrate_jobs_db(db_dsn)


@pytest.fixture
def conn(jobs_db: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(jobs_db, autocommit=True) as c:
        yield c


def _enqueue(conn: psycopg.Connection[Any], n: int) -> None:
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={}) for _ in range(n)])


def _succeeded(dsn: str) -> int:
    return int(rows(dsn, "SELECT count(*) FROM jobs WHERE status = 'succeeded'")[0][0])


def _events(logged: list[dict[str, Any]], name: str, since: float) -> list[dict[str, Any]]:
    return [e for e in logged if e["event"] == name and e["at"] >= since]


class Ran:
    """The handler: how many times each job ran."""

    def __init__(self) -> None:
        self.times: Counter[int] = Counter()
        self._lock = threading.Lock()

    def __call__(self, ctx: Any) -> str:
        with self._lock:
            self.times[int(ctx.job.id)] += 1
        return "fine"


def test_a_pool_whose_database_stops_answering_is_not_ready_says_why_once_and_runs_every_job_once(
        jobs_db: str, conn: psycopg.Connection[Any], tcp_proxy: Any) -> None:
    info = conninfo_to_dict(jobs_db)
    proxy = tcp_proxy(str(info.get("host") or "127.0.0.1"), int(str(info["port"])))
    ran, logged, metrics = Ran(), [], JobsMetrics()
    config = WorkerConfig(dsn=make_conninfo(jobs_db, host="127.0.0.1", port=str(proxy.port)), max_concurrency=2,
                          poll_interval_s=0.1, drain_timeout_s=1.0)  # the default lease: 30 s
    pool = WorkerPool(config, {"ok": ran}, metrics=metrics, log=recording_logger(logged))
    pool.start()
    try:
        _enqueue(conn, 2)
        wait_until(lambda: _succeeded(jobs_db) == 2, timeout_s=20, message="the first jobs ran")
        assert pool.health().ready
        rounds = pool.rounds
        wait_until(lambda: pool.rounds > rounds + 1, timeout_s=5, message="rounds go on")  # its connection is up
        proxy.blackhole()
        cut_at = time.monotonic()
        _enqueue(conn, 3)  # straight to the database: the pool cannot see them
        health = wait_until(lambda: h if not (h := pool.health()).ready else None, timeout_s=UNANSWERED_S + 5,
                            message=lambda: f"still ready while its round hangs: {pool.health()} "
                                            f"{[e['event'] for e in logged[-5:]]}")
        assert time.monotonic() - cut_at >= UNANSWERED_S - 0.5  # not before a round is that old
        (reason,) = health.reasons
        assert reason.startswith(HEADLINE) and "a network partition" in reason and " UTC" in reason, reason
        assert health.failed_rounds == 0  # it failed nothing: it hangs
        password = str(info.get("password") or "")
        assert not password or password not in reason
        assert metrics.registry.get_sample_value(GAUGE) == 1.0
        (line,) = wait_until(lambda: _events(logged, "dispatch_unanswered", cut_at), timeout_s=3,
                             message=lambda: f"no dispatch_unanswered: {[e['event'] for e in logged[-5:]]}")
        assert line["unanswered_s"] >= UNANSWERED_S and line["detail"].startswith(HEADLINE), line
        wait_until(lambda: pool.health().reasons[0] != reason, timeout_s=3,
                   message="the reason says how long")  # a second later: still not ready, one line
        assert not pool.health().ready and len(_events(logged, "dispatch_unanswered", cut_at)) == 1
        back_at = time.monotonic()
        proxy.restore()
        wait_until(lambda: pool.health().ready, timeout_s=10, message=lambda: str(pool.health()))
        assert metrics.registry.get_sample_value(GAUGE) == 0.0
        (recovered,) = wait_until(lambda: _events(logged, "dispatch_recovered", cut_at), timeout_s=3,
                                  message="no dispatch_recovered")
        assert recovered["at"] >= back_at and recovered["unanswered_s"] >= UNANSWERED_S, recovered
        wait_until(lambda: _succeeded(jobs_db) == 5, timeout_s=30,
                   message=lambda: str(rows(jobs_db, "SELECT id, status, attempts FROM jobs")))
    finally:
        proxy.restore()
        pool.stop()
    ids = [r[0] for r in rows(jobs_db, "SELECT id FROM jobs ORDER BY id")]
    assert len(ids) == 5 and dict(ran.times) == dict.fromkeys(ids, 1), ran.times
    assert rows(jobs_db, "SELECT job_id, count(*) FROM job_audit WHERE status = 'succeeded' GROUP BY 1 "
                         "ORDER BY 1") == [(i, 1) for i in ids]
    assert dict(pool.outcomes) == {"succeeded": 5}
    assert len(_events(logged, "dispatch_unanswered", cut_at)) == 1
    assert not [e for e in logged if e["event"] in ("pool_failed", "dispatch_crashed", "dispatch_failed")]
    assert metrics.registry.get_sample_value(GAUGE) == 0.0


def test_in_a_partition_that_drops_packets_the_pool_stays_not_ready_once_tcp_gives_up(
        jobs_db: str, conn: psycopg.Connection[Any]) -> None:
    info = conninfo_to_dict(jobs_db)
    ran, logged, metrics = Ran(), [], JobsMetrics()
    lease_s = UNANSWERED_S + 3  # TCP gives up on the hung round 3 s after the pool says so
    with veth_link(str(info.get("host") or "127.0.0.1"), int(str(info["port"]))) as link:
        config = WorkerConfig(dsn=make_conninfo(jobs_db, host=link.host, port=str(link.port)), max_concurrency=2,
                              lease_duration_s=lease_s, poll_interval_s=0.1, drain_timeout_s=1.0)
        pool = WorkerPool(config, {"ok": ran}, metrics=metrics, log=recording_logger(logged))
        pool.start()
        healed = False
        try:
            _enqueue(conn, 2)
            wait_until(lambda: _succeeded(jobs_db) == 2, timeout_s=20, message="the first jobs ran")
            link.drop()
            cut_at = time.monotonic()
            _enqueue(conn, 2)
            wait_until(lambda: not pool.health().ready, timeout_s=UNANSWERED_S + 5,
                       message=lambda: f"still ready while its round hangs: {pool.health()}")
            assert pool.health().reasons[0].startswith(HEADLINE)
            ready_meanwhile: list[Any] = []

            def failed_a_while_ago() -> bool:  # every health() meanwhile is sampled
                if (health := pool.health()).ready:
                    ready_meanwhile.append(health)
                failed = _events(logged, "dispatch_failed", cut_at)
                return bool(failed) and time.monotonic() - failed[0]["at"] >= 3.0

            wait_until(failed_a_while_ago, timeout_s=lease_s + 10, interval_s=0.02,
                       message=lambda: f"the hung round never failed: {[e['event'] for e in logged[-5:]]}")
            assert not ready_meanwhile, ready_meanwhile[:1]
            assert metrics.registry.get_sample_value(GAUGE) == 1.0
            assert len(_events(logged, "dispatch_unanswered", cut_at)) == 1
            back_at = time.monotonic()
            link.heal()
            healed = True
            wait_until(lambda: pool.health().ready, timeout_s=15, message=lambda: str(pool.health()))
            (recovered,) = _events(logged, "dispatch_recovered", cut_at)
            assert recovered["at"] >= back_at and recovered["rounds"] >= 1, recovered
            wait_until(lambda: _succeeded(jobs_db) == 4, timeout_s=30,
                       message=lambda: str(rows(jobs_db, "SELECT id, status, attempts FROM jobs")))
        finally:
            if not healed:
                link.heal()
            pool.stop()
    assert sorted(ran.times.values()) == [1, 1, 1, 1]
    assert metrics.registry.get_sample_value(GAUGE) == 0.0


def test_a_lock_wait_keeps_the_pool_ready_and_is_named_as_one(jobs_db: str, conn: psycopg.Connection[Any]) -> None:
    ran, logged, metrics = Ran(), [], JobsMetrics()
    pool = WorkerPool(WorkerConfig(dsn=jobs_db, max_concurrency=2, poll_interval_s=0.1, listen=False,
                                   drain_timeout_s=1.0), {"ok": ran}, metrics=metrics, log=recording_logger(logged))
    pool.start()
    try:
        _enqueue(conn, 1)
        wait_until(lambda: _succeeded(jobs_db) == 1, timeout_s=20, message="the first job ran")
        locked_at = time.monotonic()
        with psycopg.connect(jobs_db) as locker:  # an operator's LOCK TABLE, held
            locker.execute("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")
            not_ready: list[Any] = []

            def waited_long() -> bool:
                if not (health := pool.health()).ready:
                    not_ready.append(health)
                gauge = metrics.registry.get_sample_value("outbox_jobs_lock_wait_seconds", {"queue": "bulk"})
                return (gauge or 0.0) >= UNANSWERED_S + 2

            wait_until(waited_long, timeout_s=UNANSWERED_S + 15, message="the lock wait was not seen")
            assert not not_ready, not_ready[:1]
            assert metrics.registry.get_sample_value(GAUGE) == 0.0
            assert _events(logged, "jobs_lock_wait", locked_at)
            assert not _events(logged, "dispatch_unanswered", locked_at)
        _enqueue(conn, 2)
        wait_until(lambda: _succeeded(jobs_db) == 3, timeout_s=20, message="the jobs ran once the lock was gone")
    finally:
        pool.stop()
    assert sorted(ran.times.values()) == [1, 1, 1]
