"""A worker pool whose database is unreachable (the network cut) or read-only (a failover to
a standby) for a while, on a real PostgreSQL: what its health, its log and its gauge say.

The pool sits behind a TCP proxy: ``cut()`` resets its connections and refuses new ones, as a
database stopped or a network cut does.  Read-only is ``default_transaction_read_only`` set on
the test's database and its sessions ended, as a failover ends them (as in
``test_jobs_read_only.py``).

Every dispatch round failed and logged ``dispatch_failed``, and ``health()`` said ready all
along: a readiness probe kept routing work to a pool that could claim nothing, and the log got
a line per round (an audit of the pool).  Now the pool is not ready after two failed rounds
and two seconds, says why, logs the outage once and its end once, and the gauge
``outbox_jobs_database_unavailable`` is 1 meanwhile; every job, enqueued before or during the
outage, runs once when the database is back.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from consumer_sdk.jobs import JobsMetrics, NewJob, WorkerConfig, WorkerPool, enqueue
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import WRITABLE, recording_logger, rows, set_read_only

GAUGE = "outbox_jobs_database_unavailable"
#: Failed rounds to see before the database comes back (about 20 a second: poll_interval_s 0.05).
ROUNDS = 12



def _enqueue(dsn: str, n: int) -> None:
    """``n`` jobs, on a connection of their own (the database may be read-only for others)."""
    with psycopg.connect(dsn, autocommit=True, options=WRITABLE) as conn:
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={}) for _ in range(n)])


def _events(logged: list[dict[str, Any]], name: str, since: float) -> list[dict[str, Any]]:
    return [e for e in logged if e["event"] == name and e["at"] >= since]


@pytest.mark.parametrize("outage", ["unreachable", "read_only"])
def test_a_pool_whose_database_is_out_is_not_ready_says_why_once_and_runs_every_job_once_it_is_back(
        jobs_db: str, tcp_proxy: Any, outage: str) -> None:
    info = conninfo_to_dict(jobs_db)
    proxy = tcp_proxy(str(info.get("host") or "127.0.0.1"), int(str(info["port"])))
    ran: Counter[int] = Counter()
    ran_lock = threading.Lock()

    def ok(ctx: Any) -> str:
        with ran_lock:
            ran[int(ctx.job.id)] += 1
        return "fine"

    logged: list[dict[str, Any]] = []
    metrics = JobsMetrics()
    config = WorkerConfig(dsn=make_conninfo(jobs_db, host="127.0.0.1", port=str(proxy.port)), max_concurrency=2,
                          lease_duration_s=10.0, poll_interval_s=0.05, reconcile_interval_s=0.5, listen=False,
                          drain_timeout_s=1.0)
    pool = WorkerPool(config, {"ok": ok}, metrics=metrics, log=recording_logger(logged))
    pool.start()
    try:
        _enqueue(jobs_db, 2)
        wait_until(lambda: rows(jobs_db, "SELECT count(*) FROM jobs WHERE status = 'succeeded'") == [(2,)],
                   timeout_s=20, message="the first jobs ran")
        assert pool.health().ready
        _enqueue(jobs_db, 3)  # some may be in flight when the database goes
        out_at = time.monotonic()
        if outage == "unreachable":
            proxy.cut()
        else:
            set_read_only(jobs_db, True, end_sessions=True)
        _enqueue(jobs_db, 3)
        health = wait_until(lambda: h if not (h := pool.health()).ready and h.failed_rounds >= ROUNDS else None,
                            timeout_s=20, message=lambda: f"still ready while its rounds fail: {pool.health()} "
                                                          f"{[e['event'] for e in logged[-5:]]}")
        (reason,) = health.reasons
        headline = ("the database is unavailable" if outage == "unreachable"
                    else "the database is read-only (a standby, or a failover in progress)")
        assert reason.startswith(headline) and "dispatch rounds failed in a row" in reason, reason
        assert ("read-only" in reason) == (outage == "read_only"), reason
        password = str(info.get("password") or "")
        assert not password or password not in reason
        assert metrics.registry.get_sample_value(GAUGE) == 1.0
        failed = _events(logged, "dispatch_failed", out_at)
        types = [e["error_type"] for e in failed]
        # One line for the outage (two when a failover first ends a round's session: unavailable,
        # then read-only): not one per round.
        assert len(types) == len(set(types)) and len(failed) < ROUNDS, failed
        if outage == "unreachable":
            # The cut finds the dispatcher in a round (its connection closed under it) or between
            # two (the next one's connection reset): libpq words them differently.
            assert types == ["DatabaseUnavailable"] and any(
                words in failed[0]["error"] for words in ("server closed the connection", "Connection reset by peer",
                                                          "connection refused", "Connection refused")), failed
        else:
            assert types[-1] == "DatabaseReadOnly" and "read-only" in failed[-1]["error"], failed
        assert failed[0]["rounds"] == 1
        back_at = time.monotonic()
        if outage == "unreachable":
            proxy.restore()
        else:
            set_read_only(jobs_db, False, end_sessions=False)  # the read-only sessions stay read-only
        wait_until(lambda: pool.health().ready, timeout_s=20, message=lambda: str(pool.health()))
        assert metrics.registry.get_sample_value(GAUGE) == 0.0
        (recovered,) = _events(logged, "dispatch_recovered", out_at)
        assert recovered["rounds"] >= ROUNDS and recovered["failed_s"] >= 2.0, recovered
        assert recovered["at"] >= back_at
        assert pool.health().failed_rounds == 0
        wait_until(lambda: rows(jobs_db, "SELECT count(*) FROM jobs WHERE status = 'succeeded'") == [(8,)],
                   timeout_s=30, message=lambda: str(rows(jobs_db, "SELECT id, status, attempts FROM jobs")))
    finally:
        proxy.restore()
        set_read_only(jobs_db, False, end_sessions=False)
        pool.stop()
    # Every job ran once and succeeded once.
    ids = [r[0] for r in rows(jobs_db, "SELECT id FROM jobs ORDER BY id")]
    assert len(ids) == 8 and dict(ran) == dict.fromkeys(ids, 1), ran
    assert rows(jobs_db, "SELECT job_id, count(*) FROM job_audit WHERE status = 'succeeded' GROUP BY 1 "
                         "ORDER BY 1") == [(i, 1) for i in ids]
    assert dict(pool.outcomes) == {"succeeded": 8}
    assert len(_events(logged, "dispatch_failed", out_at)) == len(failed)  # none after it was over, either
    assert not [e for e in logged if e["event"] in ("pool_failed", "dispatch_crashed")]
    assert metrics.registry.get_sample_value(GAUGE) == 0.0
