"""A timed-out attempt's failure (``handler_timeout_s``) whose write committed but whose reply
never came back, or whose write never reached the server, on a real PostgreSQL behind the
fault proxy.

The heartbeat writes that failure (a retry, or the dead letter after the last attempt) on
its own connection.  The proxy forwards the write (it carries ``HandlerTimedOut``, the error
type, a marker the proxy looks for) and from then on holds the server's bytes on that
connection, or drops the write; then it cuts every connection.  The pool logged
``job_timeout_write_failed`` ("its lease expires and the job is reaped") and counted the
attempt lost, for a retry or a dead letter the database had; a write that never arrived
left the job running until its lease ran out.  Now the write is sent again on a new
connection, which asks the database under the lease's token when it matches no row: the
outcome is confirmed (``outcome_confirmed``) or written, and counted once.  Asked again at
each heartbeat, never waited for on the heartbeat's thread; a database away past the lease's
local deadline ends the asking, with a line that says the failure may have been written.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from consumer_sdk.jobs import Backoff, JobsMetrics, NewJob, WorkerConfig, WorkerPool, enqueue
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import recording_logger, rows
from tests.integration.jobs.test_jobs_lost_reply_executor import held_after  # noqa: F401 - the fixture

ERROR = "HandlerTimedOut: handler timed out after 1 s"

#: The attempt's failure: a retry (attempts left) or its dead letter (the last attempt).
WRITES = {
    "retry": {"max_attempts": 3, "outcome": "retried", "status": "queued"},
    "dead_letter": {"max_attempts": 1, "outcome": "failed", "status": "failed"},
}


def _hanging_pool(jobs_db: str, proxy: Any, release: threading.Event, metrics: JobsMetrics,
                  events: list[dict[str, Any]], **config: Any) -> WorkerPool:
    """One job at a time through the proxy; its handler hangs past handler_timeout_s (1 s)
    until ``release``, ignoring its cancellation as a hung call would."""
    return WorkerPool(WorkerConfig(dsn=make_conninfo(jobs_db, host="127.0.0.1", port=str(proxy.port)),
                                   max_concurrency=1, heartbeat_interval_s=0.2, poll_interval_s=0.1, listen=False,
                                   drain_timeout_s=1.0, handler_timeout_s=1.0,
                                   backoff=Backoff(initial_s=60.0, max_s=60.0), **config),
                      {"hang": lambda ctx: release.wait(60) and "late"}, metrics=metrics, log=recording_logger(events))


@pytest.mark.parametrize("lost", ["reply", "write"])
@pytest.mark.parametrize("kind", sorted(WRITES))
def test_a_timed_out_attempts_failure_whose_reply_was_lost_is_confirmed_or_written_again(
        conn, jobs_db, tcp_proxy, held_after, kind: str, lost: str) -> None:  # noqa: F811 - the fixture
    spec = WRITES[kind]
    info = conninfo_to_dict(jobs_db)
    proxy = tcp_proxy(str(info.get("host") or "127.0.0.1"), int(str(info["port"])))
    held_after.update(marker=b"HandlerTimedOut", drop=lost == "write")
    release = threading.Event()  # the hung handler returns only when the test ends
    events: list[dict[str, Any]] = []
    metrics = JobsMetrics()
    pool = _hanging_pool(jobs_db, proxy, release, metrics, events, lease_duration_s=10.0)
    pool.start()
    try:
        (job_id,) = enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="hang", payload={},
                                          max_attempts=spec["max_attempts"])])
        assert held_after["held"].wait(30), "the timed-out attempt's failure was not seen"
        if lost == "reply":
            wait_until(lambda: rows(jobs_db, "SELECT status FROM jobs") == [(spec["status"],)], timeout_s=20,
                       message="the server committed the failure")
        else:
            assert rows(jobs_db, "SELECT status FROM jobs") == [("running",)]
        proxy.cut()  # its reply (or the write itself) never reaches the pool
        proxy.restore()
        wait_until(lambda: pool.outcomes[spec["outcome"]] + pool.outcomes["lost"] >= 1, timeout_s=20,
                   message=lambda: f"the failure settled: {[e['event'] for e in events]}")
        failed = [e for e in events if e["event"] == "job_timeout_write_failed"]
        assert not failed, [e["error"] for e in failed]
        assert dict(pool.outcomes) == {spec["outcome"]: 1}, pool.outcomes
        confirmed = [(e["job_id"], e["outcome"]) for e in events if e["event"] == "outcome_confirmed"]
        assert confirmed == ([(job_id, spec["outcome"])] if lost == "reply" else []), confirmed
        assert [(e["job_id"], e["outcome"]) for e in events if e["event"] == "job_timed_out"] == \
            [(job_id, spec["outcome"])]
        # Written once, as the heartbeat's write leaves it: not left to its lease.
        assert rows(jobs_db, "SELECT status, attempts, last_error FROM jobs") == [(spec["status"], 1, ERROR)]
        transitions = rows(jobs_db, "SELECT status FROM job_audit ORDER BY at")
        assert [t[0] for t in transitions] == ["running", spec["status"]], transitions
    finally:
        release.set()
        pool.stop()
    value = metrics.registry.get_sample_value
    if kind == "retry":
        assert value("outbox_jobs_retries_total", {"queue": "bulk"}) == 1.0
    else:
        assert value("outbox_jobs_dead_lettered_total", {"queue": "bulk", "reason": "attempts_exhausted"}) == 1.0
        assert value("outbox_jobs_finished_total", {"queue": "bulk", "status": "failed"}) == 1.0
        assert rows(jobs_db, "SELECT reason, error FROM job_dead_letters") == [("attempts_exhausted", ERROR)]


#: The retry committed, its reply was lost, and the database stays away (every new connection
#: reset) until the asking ends: at the lease's local deadline (a 3 s lease), or when the pool
#: stops well before it (a 30 s lease: asked once more as the heartbeat ends; before, the stop
#: dropped it without a word, no line, no count).  Either way the pool says the failure may
#: have been written, and counts the attempt lost.
UNANSWERED = {
    "deadline": {"lease_s": 3.0, "said": "its reply lost, and the database could not be asked before the lease's "
                                         "deadline: if it was not written, its lease"},
    "stop": {"lease_s": 30.0, "said": "its reply lost, and the pool stopped before the database could be asked: "
                                      "if it was not written, its lease"},
}


@pytest.mark.parametrize("until", sorted(UNANSWERED))
def test_a_timed_out_attempts_failure_whose_reply_was_lost_is_asked_until_the_deadline_or_the_stop(
        conn, jobs_db, tcp_proxy, held_after, until: str) -> None:  # noqa: F811 - the fixture
    spec = UNANSWERED[until]
    info = conninfo_to_dict(jobs_db)
    proxy = tcp_proxy(str(info.get("host") or "127.0.0.1"), int(str(info["port"])))
    held_after.update(marker=b"HandlerTimedOut")
    release = threading.Event()
    events: list[dict[str, Any]] = []
    pool = _hanging_pool(jobs_db, proxy, release, JobsMetrics(), events, lease_duration_s=spec["lease_s"])
    pool.start()
    try:
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="hang", payload={}, max_attempts=3)])
        assert held_after["held"].wait(30), "the timed-out attempt's failure was not seen"
        wait_until(lambda: rows(jobs_db, "SELECT status FROM jobs") == [("queued",)], timeout_s=20,
                   message="the server committed the failure")
        proxy.cut()  # and stays cut: the failure cannot be sent again nor asked about
        if until == "deadline":
            wait_until(lambda: pool.outcomes["lost"] == 1, timeout_s=20,
                       message=lambda: f"the pool still asks: {[e['event'] for e in events]}")
        else:
            wait_until(lambda: any(e["event"] == "job_write_unconfirmed" for e in events), timeout_s=20,
                       message=lambda: f"the lost reply was not noticed: {[e['event'] for e in events]}")
    finally:
        release.set()
        pool.stop()
        proxy.restore()
    (failed,) = [e for e in events if e["event"] == "job_timeout_write_failed"]
    assert spec["said"] in failed["detail"], failed
    names = [e["event"] for e in events]
    assert names.index("job_write_unconfirmed") < names.index("job_timeout_write_failed"), names
    assert "outcome_confirmed" not in names and "job_timed_out" not in names, names
    # Counted lost once (the hung handler's late return is "timed_out": nothing written for it).
    assert pool.outcomes["lost"] == 1 and "retried" not in pool.outcomes, pool.outcomes
    assert rows(jobs_db, "SELECT status, attempts, last_error FROM jobs") == [("queued", 1, ERROR)]
