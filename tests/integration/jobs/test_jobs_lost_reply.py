"""A completion whose statement committed but whose reply never came back (the connection died
after the server committed), on a real PostgreSQL behind the fault proxy.

The proxy forwards the round's statement (it carries the job's result, a marker the proxy
looks for) and from then on holds the server's bytes on that connection; once the database
shows the job succeeded, the proxy cuts every connection.  The pool's next round sends the
completion again: it matched no row (the job is no longer running), and the pool reported a
lease lost (``lease_lost``, ``outbox_jobs_leases_lost{reason="write_refused"}``) for a job
it had completed (an audit of the pool, simulated there).  Now the resent completion asks
the database, which shows it completed by the same lease: ``completions_unconfirmed`` then
``completion_confirmed``, the job counted as succeeded once.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from consumer_sdk.jobs import JobsMetrics, NewJob, WorkerConfig, WorkerPool, enqueue
from tests.fixtures import proxy as proxy_module
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import recording_logger, rows


@pytest.fixture
def held_after(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The first time a client sends bytes holding ``state["marker"]``, the proxy forwards them
    and then stops reading the server's side of that connection: the reply stays in the proxy."""
    state: dict[str, Any] = {"marker": None, "held": threading.Event()}
    forward = proxy_module._Side.data_received  # noqa: SLF001 - the fixture's own data path

    def data_received(side: Any, data: bytes) -> None:
        forward(side, data)
        marker = state["marker"]
        if side.name == "client" and marker is not None and marker in data and side.peer is not None:
            side.peer.pause("reply_held")
            state["marker"] = None  # once: the completion sent again goes through
            state["held"].set()

    monkeypatch.setattr(proxy_module._Side, "data_received", data_received)  # noqa: SLF001
    return state


def test_a_completion_committed_whose_reply_was_lost_is_confirmed_not_reported_lost(conn, jobs_db, tcp_proxy,
                                                                                     held_after) -> None:
    info = conninfo_to_dict(jobs_db)
    proxy = tcp_proxy(str(info.get("host") or "127.0.0.1"), int(str(info["port"])))
    marker = f"reply-lost-{uuid.uuid4().hex}"
    held_after["marker"] = marker.encode()
    go = threading.Event()
    events: list[dict[str, Any]] = []

    def work(ctx: Any) -> dict[str, str]:
        go.wait(20)
        return {"marker": marker}

    metrics = JobsMetrics()
    pool = WorkerPool(WorkerConfig(dsn=make_conninfo(jobs_db, host="127.0.0.1", port=str(proxy.port)),
                                   max_concurrency=1, lease_duration_s=10.0, poll_interval_s=0.1,
                                   reconcile_interval_s=5.0, listen=False, drain_timeout_s=1.0),
                      {"work": work}, metrics=metrics, log=recording_logger(events))
    pool.start()
    try:
        (job_id,) = enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="work", payload={})])
        wait_until(lambda: rows(jobs_db, "SELECT status FROM jobs") == [("running",)], timeout_s=20,
                   message="claimed")
        go.set()  # the success goes to the dispatcher's next round
        assert held_after["held"].wait(20), "the round carrying the completion was not seen"
        wait_until(lambda: rows(jobs_db, "SELECT status FROM jobs") == [("succeeded",)], timeout_s=10,
                   message="the server committed the completion")
        proxy.cut()  # its reply never reaches the pool
        proxy.restore()
        wait_until(lambda: pool.outcomes["succeeded"] + pool.outcomes["lost"] >= 1, timeout_s=20,
                   message=lambda: f"the completion settled: {[e['event'] for e in events]}")
    finally:
        go.set()
        pool.stop()
    names = [e["event"] for e in events]
    assert "completions_unconfirmed" in names, names
    (confirmed,) = [e for e in events if e["event"] == "completion_confirmed"]
    assert confirmed["job_id"] == job_id
    assert "lease_lost" not in names, names
    assert dict(pool.outcomes) == {"succeeded": 1}
    value = metrics.registry.get_sample_value
    assert value("outbox_jobs_finished_total", {"queue": "bulk", "status": "succeeded"}) == 1.0
    assert not [s for f in metrics.registry.collect() if f.name == "outbox_jobs_leases_lost"
                for s in f.samples if s.name.endswith("_total") and s.value]
    assert rows(jobs_db, "SELECT status, attempts, result->>'marker' FROM jobs") == [("succeeded", 1, marker)]
    assert rows(jobs_db, "SELECT count(*) FROM job_audit WHERE status = 'succeeded'") == [(1,)]
