"""Test 2 of the issue: one run per (owner, request key), also concurrently; another body
under the same key is rejected.  Plus admission control, trace context and the outbox
event written in accept's transaction."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from consumer_sdk.jobs import (
    AdmissionPolicy,
    AdmissionRefused,
    JobsMetrics,
    RequestKeyConflict,
    TransactionActive,
    accept,
    run_status,
)
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import rows, scalar

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_the_same_key_and_body_return_the_existing_run(conn, jobs_db):
    first = accept(conn, owner_id="u1", request_key="k1", kind="report", body={"q": [1, 2]})
    again = accept(conn, owner_id="u1", request_key="k1", kind="report", body={"q": [1, 2]})
    assert first.created and not again.created
    assert (again.run_id, again.job_id) == (first.run_id, first.job_id)
    # Another owner may use the same key for its own run.
    other = accept(conn, owner_id="u2", request_key="k1", kind="report", body={"q": [1, 2]})
    assert other.created and other.run_id != first.run_id
    assert scalar(jobs_db, "SELECT count(*) FROM runs") == 2
    assert scalar(jobs_db, "SELECT count(*) FROM jobs") == 2


def test_the_same_key_with_another_body_is_rejected_never_reinterpreted(conn, jobs_db):
    first = accept(conn, owner_id="u1", request_key="k1", kind="report", body={"q": 1})
    with pytest.raises(RequestKeyConflict, match="different body") as err:
        accept(conn, owner_id="u1", request_key="k1", kind="report", body={"q": 2})
    assert err.value.run_id == first.run_id
    with pytest.raises(RequestKeyConflict):
        accept(conn, owner_id="u1", request_key="k1", kind="other-kind", body={"q": 1})
    assert rows(jobs_db, "SELECT goal FROM runs") == [({"q": 1},)]


def _paused_accept(dsn: str, body: Any, inside: threading.Event, release: threading.Event,
                   out: dict[str, Any]) -> None:
    def hold(_conn: Any, _accepted: Any) -> None:
        inside.set()
        release.wait(20)

    with psycopg.connect(dsn, autocommit=True) as c:
        out["first"] = accept(c, owner_id="u1", request_key="k1", kind="r", body=body, on_accept=hold)


def _second_accept(dsn: str, body: Any, out: dict[str, Any]) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        try:
            out["second"] = accept(c, owner_id="u1", request_key="k1", kind="r", body=body)
        except RequestKeyConflict as exc:
            out["second"] = exc


@pytest.mark.parametrize("second_body", [{"same": True}, {"other": True}], ids=["same_body", "other_body"])
def test_concurrent_accepts_of_one_key_from_two_connections(jobs_db, second_body):
    """The first accept is held inside its transaction (after its insert, before its
    commit) while the second runs: the second waits on the unique index, then reads
    the committed run."""
    inside, release, out = threading.Event(), threading.Event(), {}
    first = threading.Thread(target=_paused_accept, args=(jobs_db, {"same": True}, inside, release, out))
    first.start()
    assert inside.wait(10)
    second = threading.Thread(target=_second_accept, args=(jobs_db, second_body, out))
    second.start()
    wait_until(lambda: scalar(jobs_db, "SELECT count(*) FROM pg_stat_activity WHERE datname = "
                                       "current_database() AND wait_event_type = 'Lock'"),
               timeout_s=10, message="the second accept never waited for the first")
    release.set()
    first.join(10)
    second.join(10)
    assert out["first"].created
    if second_body == {"same": True}:
        assert not out["second"].created and out["second"].run_id == out["first"].run_id
    else:
        assert isinstance(out["second"], RequestKeyConflict)
    assert scalar(jobs_db, "SELECT count(*) FROM runs") == 1
    assert scalar(jobs_db, "SELECT count(*) FROM jobs") == 1


def test_many_simultaneous_accepts_create_one_run(jobs_db):
    barrier, results, errors = threading.Barrier(8), [], []

    def one() -> None:
        with psycopg.connect(jobs_db, autocommit=True) as c:
            barrier.wait(10)
            try:
                results.append(accept(c, owner_id="u1", request_key="burst", kind="r", body={"n": 1}))
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert errors == []
    assert sum(r.created for r in results) == 1
    assert len({r.run_id for r in results}) == 1
    assert scalar(jobs_db, "SELECT count(*) FROM jobs") == 1


def test_accept_refuses_inside_a_callers_transaction(conn):
    with conn.transaction():
        with pytest.raises(TransactionActive):
            accept(conn, owner_id="u1", request_key="k", kind="r", body={})


def test_the_run_the_job_and_the_event_commit_together_with_the_trace_context(conn, jobs_db):
    def fail_late(_conn: Any, _accepted: Any) -> None:
        raise RuntimeError("the caller's own write failed")

    with pytest.raises(RuntimeError):
        accept(conn, owner_id="u1", request_key="k0", kind="r", body={}, events_topic="runs",
               on_accept=fail_late, traceparent=TRACEPARENT)
    assert scalar(jobs_db, "SELECT count(*) FROM runs") == 0
    assert scalar(jobs_db, "SELECT count(*) FROM outbox") == 0

    run = accept(conn, owner_id="u1", request_key="k1", kind="r", body={"a": 1}, events_topic="runs",
                 traceparent=TRACEPARENT, tracestate="vendor=1")
    assert rows(jobs_db, "SELECT r.traceparent, j.traceparent, j.tracestate FROM runs r "
                         "JOIN jobs j ON j.run_id = r.id") == [(TRACEPARENT, TRACEPARENT, "vendor=1")]
    ((topic, key, payload, headers),) = rows(jobs_db, "SELECT topic, key, payload, headers FROM outbox")
    assert (topic, key) == ("runs", str(run.run_id))
    assert payload["type"] == "run.accepted" and payload["job_id"] == run.job_id
    assert headers["traceparent"] == TRACEPARENT and headers["jobs_queue"] == "interactive"
    assert run_status(conn, run.run_id).traceparent == TRACEPARENT


def test_admission_control_refuses_early_with_a_retry_after(conn):
    metrics = JobsMetrics()
    policy = AdmissionPolicy(capacity_per_s=1.0, horizon_s=3.0)  # at most 3 pending
    for i in range(3):
        accept(conn, owner_id="u1", request_key=f"k{i}", kind="r", body={}, queue="bulk",
               admission=policy, metrics=metrics)
    with pytest.raises(AdmissionRefused) as refused:
        accept(conn, owner_id="u1", request_key="k3", kind="r", body={}, queue="bulk",
               admission=policy, metrics=metrics)
    assert refused.value.retry_after_s >= 1 and refused.value.queue == "bulk"
    assert refused.value.pending >= 3
    # A repeat of an accepted request is answered, not refused; other queues are not affected.
    assert not accept(conn, owner_id="u1", request_key="k0", kind="r", body={}, queue="bulk",
                      admission=policy).created
    assert accept(conn, owner_id="u1", request_key="i1", kind="r", body={}, admission=policy).created
    assert metrics.registry.get_sample_value("outbox_jobs_admission_refused_total", {"queue": "bulk"}) == 1
    assert metrics.registry.get_sample_value("outbox_jobs_runs_accepted_total", {"queue": "bulk"}) == 3
