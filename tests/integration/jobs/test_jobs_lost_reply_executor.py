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
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from consumer_sdk.jobs import JobsMetrics, NewJob, WorkerConfig, WorkerPool, enqueue
from consumer_sdk.jobs.completions import MAX_ROUND_CHARS
from tests.fixtures import proxy as proxy_module
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import recording_logger, rows

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
    pool = WorkerPool(WorkerConfig(dsn=make_conninfo(jobs_db, host="127.0.0.1", port=str(proxy.port)),
                                   max_concurrency=1, lease_duration_s=10.0, poll_interval_s=0.1,
                                   reconcile_interval_s=5.0, listen=False, drain_timeout_s=1.0,
                                   events_topic=TOPIC if path == "events_topic" else None),
                      {"work": work}, metrics=metrics, log=recording_logger(events))
    pool.start()
    try:
        (job_id,) = enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="work", payload={})])
        wait_until(lambda: rows(jobs_db, "SELECT status FROM jobs") == [("running",)], timeout_s=20,
                   message="claimed")
        go.set()  # the executor writes the success itself
        assert held_after["held"].wait(30), "the executor's completion was not seen"
        wait_until(lambda: rows(jobs_db, "SELECT status FROM jobs") == [("succeeded",)], timeout_s=20,
                   message="the server committed the completion")
        proxy.cut()  # its reply never reaches the pool
        proxy.restore()
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
    pool = WorkerPool(WorkerConfig(dsn=make_conninfo(jobs_db, host="127.0.0.1", port=str(proxy.port)),
                                   max_concurrency=1, lease_duration_s=10.0, poll_interval_s=0.1,
                                   reconcile_interval_s=5.0, listen=False, drain_timeout_s=1.0, events_topic=TOPIC),
                      {"work": lambda ctx: go.wait(20) and {"marker": marker}}, metrics=metrics,
                      log=recording_logger(events))
    pool.start()
    try:
        (job_id,) = enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="work", payload={})])
        wait_until(lambda: rows(jobs_db, "SELECT status FROM jobs") == [("running",)], timeout_s=20,
                   message="claimed")
        go.set()
        assert held_after["held"].wait(30), "the executor's completion was not seen"
        assert rows(jobs_db, "SELECT status FROM jobs") == [("running",)]
        proxy.cut()
        proxy.restore()
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
