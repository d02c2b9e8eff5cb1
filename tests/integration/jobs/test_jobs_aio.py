"""consumer_sdk.jobs.aio on psycopg.AsyncConnection, tested like the sync accept, status and
activate (tests/integration/jobs/test_jobs_accept.py, test_jobs_waiting.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
import pytest

from consumer_sdk.jobs import (
    AdmissionPolicy,
    AdmissionRefused,
    JobsMetrics,
    RequestKeyConflict,
    TransactionActive,
    WaitFor,
    accept,
    aio,
    waits,
)
from tests.integration.jobs._support import claim_next, rows, scalar

T = TypeVar("T")
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def run(dsn: str, body: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]]) -> T:
    async def main() -> T:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            return await body(conn)

    return asyncio.run(main())


def test_the_same_key_and_body_return_the_existing_run_and_another_body_is_refused(jobs_db):
    async def body(conn: Any) -> None:
        first = await aio.accept(conn, owner_id="u1", request_key="k1", kind="report", body={"q": [1, 2]})
        again = await aio.accept(conn, owner_id="u1", request_key="k1", kind="report", body={"q": [1, 2]})
        assert first.created and not again.created and again.run_id == first.run_id
        with pytest.raises(RequestKeyConflict) as err:
            await aio.accept(conn, owner_id="u1", request_key="k1", kind="report", body={"q": 3})
        assert err.value.run_id == first.run_id

    run(jobs_db, body)
    assert scalar(jobs_db, "SELECT count(*) FROM runs") == 1


def test_accept_refuses_inside_a_callers_transaction(jobs_db):
    async def body(conn: Any) -> None:
        async with conn.transaction():
            with pytest.raises(TransactionActive):
                await aio.accept(conn, owner_id="u1", request_key="k", kind="r", body={})

    run(jobs_db, body)


def test_the_run_the_job_and_the_event_commit_together_and_the_status_reads_back(jobs_db):
    async def fail_late(_conn: Any, _accepted: Any) -> None:
        raise RuntimeError("the caller's own write failed")

    async def body(conn: Any) -> Any:
        with pytest.raises(RuntimeError):
            await aio.accept(conn, owner_id="u1", request_key="k0", kind="r", body={}, events_topic="runs",
                             on_accept=fail_late)
        accepted = await aio.accept(conn, owner_id="u1", request_key="k1", kind="r", body={"a": 1},
                                    events_topic="runs", traceparent=TRACEPARENT)
        state = await aio.run_status(conn, accepted.run_id, owner_id="u1")
        assert state is not None and state.status == "queued" and state.traceparent == TRACEPARENT
        assert await aio.run_status(conn, accepted.run_id, owner_id="someone-else") is None
        return accepted

    accepted = run(jobs_db, body)
    ((topic, key, payload),) = rows(jobs_db, "SELECT topic, key, payload FROM outbox")
    assert (topic, key, payload["type"]) == ("runs", str(accepted.run_id), "run.accepted")


def test_admission_control_refuses_with_a_retry_after(jobs_db):
    metrics = JobsMetrics()
    policy = AdmissionPolicy(capacity_per_s=1.0, horizon_s=2.0)

    async def body(conn: Any) -> None:
        for i in range(2):
            await aio.accept(conn, owner_id="u1", request_key=f"k{i}", kind="r", body={}, queue="bulk",
                             admission=policy, metrics=metrics)
        with pytest.raises(AdmissionRefused) as refused:
            await aio.accept(conn, owner_id="u1", request_key="k9", kind="r", body={}, queue="bulk",
                             admission=policy, metrics=metrics)
        assert refused.value.retry_after_s >= 1

    run(jobs_db, body)
    assert metrics.registry.get_sample_value("outbox_jobs_runs_accepted_total", {"queue": "bulk"}) == 2


def test_an_activation_resumes_the_parked_job_once(conn, jobs_db):
    accepted = accept(conn, owner_id="u1", request_key="k", kind="r", body={})
    (job,) = claim_next(conn, "A", now=None)
    assert waits.park(conn, job.lease, WaitFor("approval:1", "approval")) == "waiting"

    async def body(c: Any) -> tuple[Any, Any]:
        first = await aio.activate(c, "approval:1", {"ok": True}, events_topic="jobs")
        return first, await aio.activate(c, "approval:1", {"ok": False})

    first, again = run(jobs_db, body)
    assert first.recorded and first.resumed == (accepted.job_id,)
    assert not again.recorded and again.resumed == ()
    assert rows(jobs_db, "SELECT payload->>'type' FROM outbox") == [("job.resumed",)]
    (resumed,) = claim_next(conn, "B", now=None)
    assert resumed.activation == {"ok": True}
