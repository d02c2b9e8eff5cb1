"""A success the executor writes itself (not the dispatcher's round) whose write committed but
whose reply never came back, on a real PostgreSQL behind the fault proxy.

The executor writes a success itself when the pool writes terminal events (``events_topic``:
the completion and its ``job.succeeded`` event in the job's own transaction) or when the
result is too large for a round (over ``MAX_ROUND_CHARS``).  The proxy forwards that write
(it carries the job's result, a marker the proxy looks for; with events, up to its COMMIT)
and from then on holds the server's bytes on that connection; once the database shows the
job succeeded, the proxy cuts every connection.  The executor reported ``job_write_failed``
and the attempt lost (``outbox_jobs_leases_lost{reason="write_failed"}``) for a job it had
completed (its ``finished_total`` never counted).  Now the executor sends the completion again
on a new connection, which asks the database: ``job_write_unconfirmed`` then
``completion_confirmed``, the job counted as succeeded once, its event written once.

The executor's other outcome writes (a retry, a failure and its dead letter, a park, a
release) are held the same way: each is ``outcome_confirmed``, counted once by its own
metric, never ``job_write_failed`` nor a lost lease.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import psycopg
import psycopg.errors
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from consumer_sdk.errors import DatabaseUnavailable
from consumer_sdk.jobs import (
    Backoff,
    JobsMetrics,
    NewJob,
    PermanentJobError,
    WaitFor,
    WorkerConfig,
    WorkerPool,
    enqueue,
)
from consumer_sdk.jobs._conn import ConnSlot
from consumer_sdk.jobs.completions import MAX_ROUND_CHARS
from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.executor import Executor
from consumer_sdk.jobs.heartbeat import Heartbeat
from tests.fixtures import proxy as proxy_module
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import claim_next, recording_logger, rows

TOPIC = "jobs-events-lost-reply"


@pytest.fixture
def held_after(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Once a client sent bytes holding ``state["marker"]``, the proxy forwards its bytes and,
    at the first of them that hold ``state["then"]`` (None: those with the marker), stops
    reading the server's side of that connection: the reply stays in the proxy."""
    state: dict[str, Any] = {"marker": None, "then": None, "armed": None, "held": threading.Event(),
                             "drop": False}
    forward = proxy_module._Side.data_received  # noqa: SLF001 - the fixture's own data path

    def data_received(side: Any, data: bytes) -> None:
        if state["drop"] and side.name == "client" and state["marker"] and state["marker"] in data:
            state["drop"] = False  # never reaches the server: the write is lost, not its reply
            state["held"].set()
            return
        forward(side, data)
        if side.name != "client" or side.peer is None or state["held"].is_set():
            return
        if state["armed"] is None and state["marker"] is not None and state["marker"] in data:
            state["armed"] = side
        if state["armed"] is side and (state["then"] is None or state["then"] in data):
            side.peer.pause("reply_held")  # once: the completion sent again goes through
            state["held"].set()

    monkeypatch.setattr(proxy_module._Side, "data_received", data_received)  # noqa: SLF001
    return state


def _pool(jobs_db: str, proxy: Any, handler: Any, metrics: JobsMetrics, events: list[dict[str, Any]],
          **config: Any) -> WorkerPool:
    """A worker pool running one job at a time through the fault proxy (``config``: more options)."""
    return WorkerPool(WorkerConfig(dsn=make_conninfo(jobs_db, host="127.0.0.1", port=str(proxy.port)),
                                   max_concurrency=1, lease_duration_s=10.0, poll_interval_s=0.1,
                                   reconcile_interval_s=5.0, listen=False, drain_timeout_s=1.0, **config),
                      {"work": handler}, metrics=metrics, log=recording_logger(events))


def _one_job_cut_after_its_write(conn: Any, jobs_db: str, proxy: Any, go: threading.Event,
                                 held_after: dict[str, Any], *, committed: str | None) -> int:
    """Enqueue one job, let its handler end (``go``) once it is claimed, wait until the proxy
    holds the executor's write (``held_after``), then cut every connection.  ``committed``:
    the status the server has committed first (the reply is what is lost); None: the write
    was dropped, the job still running.  Returns the job's id."""
    (job_id,) = enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="work", payload={})])
    wait_until(lambda: rows(jobs_db, "SELECT status FROM jobs") == [("running",)], timeout_s=20,
               message="claimed")
    go.set()  # the handler comes to its outcome; the executor writes it
    assert held_after["held"].wait(30), "the executor's write was not seen"
    if committed is None:
        assert rows(jobs_db, "SELECT status FROM jobs") == [("running",)]
    else:
        wait_until(lambda: rows(jobs_db, "SELECT status FROM jobs") == [(committed,)], timeout_s=20,
                   message="the server committed the write")
    proxy.cut()  # its reply (or the write itself) never reaches the pool
    proxy.restore()
    return int(job_id)


@pytest.mark.parametrize("path", ["events_topic", "large_result"])
def test_a_success_the_executor_wrote_whose_reply_was_lost_is_confirmed_not_failed(
        conn, jobs_db, tcp_proxy, held_after, path: str) -> None:
    info = conninfo_to_dict(jobs_db)
    proxy = tcp_proxy(str(info.get("host") or "127.0.0.1"), int(str(info["port"])))
    marker = f"reply-lost-{uuid.uuid4().hex}"
    held_after["marker"] = marker.encode()
    held_after["then"] = b"COMMIT" if path == "events_topic" else None
    padding = "x" * (MAX_ROUND_CHARS + 1) if path == "large_result" else ""
    go = threading.Event()
    events: list[dict[str, Any]] = []

    def work(ctx: Any) -> dict[str, str]:
        go.wait(20)
        return {"marker": marker, "padding": padding}

    metrics = JobsMetrics()
    pool = _pool(jobs_db, proxy, work, metrics, events, events_topic=TOPIC if path == "events_topic" else None)
    pool.start()
    try:
        job_id = _one_job_cut_after_its_write(conn, jobs_db, proxy, go, held_after, committed="succeeded")
        wait_until(lambda: pool.outcomes["succeeded"] + pool.outcomes["lost"] >= 1, timeout_s=20,
                   message=lambda: f"the completion settled: {[e['event'] for e in events]}")
    finally:
        go.set()
        pool.stop()
    names = [e["event"] for e in events]
    assert "job_write_failed" not in names, names
    assert "job_write_unconfirmed" in names, names
    (confirmed,) = [e for e in events if e["event"] == "completion_confirmed"]
    assert confirmed["job_id"] == job_id
    assert dict(pool.outcomes) == {"succeeded": 1}
    value = metrics.registry.get_sample_value
    assert value("outbox_jobs_finished_total", {"queue": "bulk", "status": "succeeded"}) == 1.0
    assert not [s for f in metrics.registry.collect() if f.name == "outbox_jobs_leases_lost"
                for s in f.samples if s.name.endswith("_total") and s.value]
    assert rows(jobs_db, "SELECT status, attempts, result->>'marker' FROM jobs") == [("succeeded", 1, marker)]
    assert rows(jobs_db, "SELECT count(*) FROM job_audit WHERE status = 'succeeded'") == [(1,)]
    sent = rows(jobs_db, "SELECT payload->>'type', (payload->>'job_id')::bigint FROM outbox WHERE topic = %s",
                (TOPIC,))
    assert sent == ([("job.succeeded", job_id)] if path == "events_topic" else [])


def test_a_success_the_executor_wrote_that_never_reached_the_server_is_written_again(
        conn, jobs_db, tcp_proxy, held_after) -> None:
    # The other side of "the outcome is unknown": the connection broke before the write
    # reached the server.  Sent again on a new connection, it is written (not "confirmed"),
    # its event once; before, the job waited out its lease and ran again.
    info = conninfo_to_dict(jobs_db)
    proxy = tcp_proxy(str(info.get("host") or "127.0.0.1"), int(str(info["port"])))
    marker = f"write-lost-{uuid.uuid4().hex}"
    held_after.update(marker=marker.encode(), drop=True)
    go = threading.Event()
    events: list[dict[str, Any]] = []
    metrics = JobsMetrics()
    pool = _pool(jobs_db, proxy, lambda ctx: go.wait(20) and {"marker": marker}, metrics, events,
                 events_topic=TOPIC)
    pool.start()
    try:
        job_id = _one_job_cut_after_its_write(conn, jobs_db, proxy, go, held_after, committed=None)
        wait_until(lambda: pool.outcomes["succeeded"] + pool.outcomes["lost"] >= 1, timeout_s=20,
                   message=lambda: f"the completion settled: {[e['event'] for e in events]}")
    finally:
        go.set()
        pool.stop()
    names = [e["event"] for e in events]
    assert "job_write_unconfirmed" in names and "job_write_failed" not in names, names
    assert "completion_confirmed" not in names, names
    assert dict(pool.outcomes) == {"succeeded": 1}
    assert metrics.registry.get_sample_value("outbox_jobs_finished_total",
                                             {"queue": "bulk", "status": "succeeded"}) == 1.0
    assert rows(jobs_db, "SELECT status, attempts, result->>'marker' FROM jobs") == [("succeeded", 1, marker)]
    assert rows(jobs_db, "SELECT payload->>'type', (payload->>'job_id')::bigint FROM outbox WHERE topic = %s",
                (TOPIC,)) == [("job.succeeded", job_id)]


#: The executor's other outcome writes, each held as the success's is: what the handler
#: does (given the marker and its call's number), the bytes of the write to hold the reply
#: of (None: those with the marker; the release's own SQL when nothing of it is the
#: marker), the outcome confirmed, and the job's row after it.
OTHER_WRITES: dict[str, dict[str, Any]] = {
    "retry": {"then": None, "outcome": "retried", "status": "queued"},
    "dead_letter": {"then": None, "outcome": "failed", "status": "failed"},
    "dead_letter_events": {"then": b"COMMIT", "outcome": "failed", "status": "failed"},
    "park": {"then": b"COMMIT", "outcome": "waiting", "status": "waiting"},
    "release": {"then": None, "outcome": "released", "status": "queued"},
}


def _other_handler(kind: str, marker: str, go: threading.Event, calls: list[int]) -> Any:
    def work(ctx: Any) -> Any:
        calls.append(ctx.job.token)
        if kind == "release" and len(calls) > 1:
            return {"second": True}  # given back, claimed again: this attempt counts
        go.wait(20)
        if kind == "retry":
            raise RuntimeError(marker)
        if kind.startswith("dead_letter"):
            raise PermanentJobError(marker)
        if kind == "park":
            return WaitFor(key=marker, cause="approval")
        # What a transaction pooler does to psycopg's prepared statements: given back.
        raise psycopg.errors.InvalidSqlStatementName('prepared statement "_pg3_0" does not exist')
    return work


@pytest.mark.parametrize("kind", sorted(OTHER_WRITES))
def test_another_outcome_the_executor_wrote_whose_reply_was_lost_is_confirmed_not_lost(
        conn, jobs_db, tcp_proxy, held_after, kind: str) -> None:
    # A retry, a failure and its dead letter (with its event, in one transaction), a park
    # and a release, each committed and its reply held, then every connection cut.  Before,
    # each was job_write_failed, outcome lost, leases_lost{reason="write_failed"}, its own
    # metric never counted (and, had it not landed, the job waited out its lease).
    spec = OTHER_WRITES[kind]
    info = conninfo_to_dict(jobs_db)
    proxy = tcp_proxy(str(info.get("host") or "127.0.0.1"), int(str(info["port"])))
    marker = f"reply-lost-{uuid.uuid4().hex}"
    held_after.update(marker=b"greatest(0, j.attempts - 1)" if kind == "release" else marker.encode(),
                      then=spec["then"])
    go = threading.Event()
    calls: list[int] = []
    events: list[dict[str, Any]] = []
    metrics = JobsMetrics()
    topic = TOPIC if kind == "dead_letter_events" else None
    pool = _pool(jobs_db, proxy, _other_handler(kind, marker, go, calls), metrics, events,
                 backoff=Backoff(initial_s=60.0, max_s=60.0), events_topic=topic)
    pool.start()
    try:
        job_id = _one_job_cut_after_its_write(conn, jobs_db, proxy, go, held_after, committed=spec["status"])
        settled = {"released": 2}.get(spec["outcome"], 1)  # a job given back runs again
        wait_until(lambda: sum(pool.outcomes.values()) >= settled, timeout_s=20,
                   message=lambda: f"the outcome settled: {[e['event'] for e in events]}")
    finally:
        go.set()
        pool.stop()
    names = [e["event"] for e in events]
    assert "job_write_failed" not in names and "job_write_unconfirmed" in names, names
    (confirmed,) = [e for e in events if e["event"] == "outcome_confirmed"]
    assert (confirmed["job_id"], confirmed["outcome"]) == (job_id, spec["outcome"])
    assert not [s for f in metrics.registry.collect() if f.name == "outbox_jobs_leases_lost"
                for s in f.samples if s.name.endswith("_total") and s.value]
    _assert_counted(kind, metrics, dict(pool.outcomes), calls, jobs_db, marker, job_id)


def _assert_counted(kind: str, metrics: JobsMetrics, outcomes: dict[str, int], calls: list[int], dsn: str,
                    marker: str, job_id: int) -> None:
    """The outcome counted once, in the pool and its metric; the job's row as one write left it."""
    value = metrics.registry.get_sample_value
    row = rows(dsn, "SELECT status, attempts, last_error, wait_key FROM jobs")
    if kind == "retry":
        assert outcomes == {"retried": 1} and len(calls) == 1
        assert value("outbox_jobs_retries_total", {"queue": "bulk"}) == 1.0
        assert row == [("queued", 1, f"RuntimeError: {marker}", None)]
    elif kind.startswith("dead_letter"):
        assert outcomes == {"failed": 1} and len(calls) == 1
        assert value("outbox_jobs_dead_lettered_total", {"queue": "bulk", "reason": "permanent_error"}) == 1.0
        assert value("outbox_jobs_finished_total", {"queue": "bulk", "status": "failed"}) == 1.0
        assert row == [("failed", 1, f"PermanentJobError: {marker}", None)]
        assert rows(dsn, "SELECT reason FROM job_dead_letters") == [("permanent_error",)]
        sent = rows(dsn, "SELECT payload->>'type', (payload->>'job_id')::bigint FROM outbox WHERE topic = %s",
                    (TOPIC,))
        assert sent == ([("job.failed", job_id)] if kind == "dead_letter_events" else [])
    elif kind == "park":
        assert outcomes == {"waiting": 1} and len(calls) == 1
        assert value("outbox_jobs_parked_total", {"queue": "bulk"}) == 1.0
        assert row == [("waiting", 0, None, marker)]
    else:  # given back (the attempt not counted), claimed again and run to its success
        assert outcomes == {"released": 1, "succeeded": 1} and len(calls) == 2 and calls[1] > calls[0]
        assert row[0][:2] == ("succeeded", 1)
    transitions = rows(dsn, "SELECT status FROM job_audit ORDER BY at")
    expected = {"retry": ["running", "queued"], "park": ["running", "waiting"],
                "release": ["running", "queued", "running", "succeeded"]}.get(kind, ["running", "failed"])
    assert [t[0] for t in transitions] == expected, transitions


@pytest.mark.parametrize("kind", ["retry", "dead_letter"])
def test_another_outcome_that_never_reached_the_server_is_written_again_not_left_to_its_lease(
        conn, jobs_db, tcp_proxy, held_after, kind: str) -> None:
    # The write is dropped before the server sees it, then every connection cut: sent again on
    # a new connection, it is written (not "confirmed"); before, the job stayed running until
    # its lease ran out, and only then was it retried or dead-lettered (by the reaper).
    spec = OTHER_WRITES[kind]
    info = conninfo_to_dict(jobs_db)
    proxy = tcp_proxy(str(info.get("host") or "127.0.0.1"), int(str(info["port"])))
    marker = f"write-lost-{uuid.uuid4().hex}"
    held_after.update(marker=marker.encode(), drop=True)
    go = threading.Event()
    calls: list[int] = []
    events: list[dict[str, Any]] = []
    metrics = JobsMetrics()
    pool = _pool(jobs_db, proxy, _other_handler(kind, marker, go, calls), metrics, events,
                 backoff=Backoff(initial_s=60.0, max_s=60.0))
    pool.start()
    try:
        job_id = _one_job_cut_after_its_write(conn, jobs_db, proxy, go, held_after, committed=None)
        wait_until(lambda: sum(pool.outcomes.values()) >= 1, timeout_s=20,
                   message=lambda: f"the outcome settled: {[e['event'] for e in events]}")
    finally:
        go.set()
        pool.stop()
    names = [e["event"] for e in events]
    assert "job_write_unconfirmed" in names and "job_write_failed" not in names, names
    assert "outcome_confirmed" not in names, names
    _assert_counted(kind, metrics, dict(pool.outcomes), calls, jobs_db, marker, job_id)
    assert rows(jobs_db, "SELECT status FROM jobs") == [(spec["status"],)]


def test_a_retry_whose_reply_was_lost_is_confirmed_even_when_the_heartbeat_saw_it_first(
        conn, jobs_db, tcp_proxy, held_after) -> None:
    # The retry committed and its reply was lost; the new connection for the write sent again
    # cannot be made, and meanwhile the heartbeat reaches the database: the job is no longer
    # running (the retry moved it).  The heartbeat read that as a lost lease and cancelled the
    # attempt: that ended the sending (job_write_failed, lost, for a retry the executor had
    # written), then earned one more try, with a lease_lost logged all the same.  Now the
    # heartbeat leaves an attempt whose outcome was sent to that write: no cancellation, no
    # lease_lost, and the write sent again finds the retry written.
    info = conninfo_to_dict(jobs_db)
    proxy = tcp_proxy(str(info.get("host") or "127.0.0.1"), int(str(info["port"])))
    marker = f"reply-lost-{uuid.uuid4().hex}"
    held_after.update(marker=marker.encode())
    events: list[dict[str, Any]] = []
    metrics = JobsMetrics()
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="work", payload={})])
    (job,) = claim_next(conn, "A", now=None, queues=("bulk",), lease_s=30.0)
    ctx = JobContext(job, deadline=time.monotonic() + 20)
    heartbeat = Heartbeat(slot=ConnSlot(lambda: psycopg.connect(jobs_db, autocommit=True)), worker_id="A",
                          lease_s=30.0, max_concurrency=1, running=lambda: [ctx], metrics=metrics,
                          log=recording_logger(events), clock=time.monotonic, db_now=lambda: None)
    reconnects: list[int] = []

    def reconnect() -> psycopg.Connection[Any]:
        reconnects.append(len(reconnects))
        if len(reconnects) == 1:  # unreachable for the executor, answering the heartbeat
            assert heartbeat.once() == 0 and not ctx.cancelled
            raise DatabaseUnavailable("database unavailable: connection refused")
        return psycopg.connect(jobs_db, autocommit=True)

    def fail(ctx: Any) -> Any:
        raise RuntimeError(marker)

    ctx.bind(psycopg.connect(make_conninfo(jobs_db, host="127.0.0.1", port=str(proxy.port)), autocommit=True),
             reconnect=reconnect)
    executor = Executor(handlers={"work": fail}, backoff=Backoff(initial_s=60.0, max_s=60.0), metrics=metrics,
                        log=recording_logger(events), events_topic=None, db_now=lambda: None)
    outcome: list[str] = []
    runner = threading.Thread(target=lambda: outcome.append(executor.run(ctx)), daemon=True)
    runner.start()
    try:
        assert held_after["held"].wait(30), "the executor's retry was not seen"
        wait_until(lambda: rows(jobs_db, "SELECT status FROM jobs") == [("queued",)], timeout_s=20,
                   message="the server committed the retry")
        proxy.cut()
        runner.join(30)
    finally:
        heartbeat.close()
        ctx.conn.close()
    names = [e["event"] for e in events]
    assert outcome == ["retried"] and len(reconnects) == 2, (outcome, names)
    assert "outcome_confirmed" in names and "job_write_failed" not in names and "lease_lost" not in names, names
    assert metrics.registry.get_sample_value("outbox_jobs_retries_total", {"queue": "bulk"}) == 1.0
    assert rows(jobs_db, "SELECT status, attempts, last_error FROM jobs") == [
        ("queued", 1, f"RuntimeError: {marker}")]
