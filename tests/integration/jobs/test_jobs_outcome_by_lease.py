"""The questions the executor asks after an outcome's reply was lost (retried_by_lease,
failed_by_lease, parked_by_lease, released_by_lease), with controlled time: each finds the
write of its own lease, and never the same write made by another claim after a takeover,
nor the reaper's requeue or dead letter of the lease that expired.

Answered wrong, a worker whose write never landed would count an outcome another worker
wrote (or the reaper's), and a job taken over would be reported as this attempt's.
"""

from __future__ import annotations

from typing import Any

import psycopg

from consumer_sdk.jobs import NewJob, WaitFor, enqueue, waits
from consumer_sdk.jobs import queue as jobq
from consumer_sdk.jobs.model import ClaimedJob
from tests.integration.jobs._support import at, claim_next

ERROR = "RuntimeError: the upstream timed out"
WAIT = WaitFor(key="approval-1", cause="approval")


def _one(conn: psycopg.Connection[Any], *, max_attempts: int = 5) -> None:
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="work", payload={}, max_attempts=max_attempts)],
            now=at(0))


def _retried(conn: psycopg.Connection[Any], job: ClaimedJob) -> float | None:
    return jobq.retried_by_lease(conn, job.lease, attempts=job.attempts, error=ERROR, error_type="RuntimeError")


def _failed(conn: psycopg.Connection[Any], job: ClaimedJob) -> Any:
    return jobq.failed_by_lease(conn, job.lease, attempts=job.attempts, reason="permanent_error", error=ERROR,
                                error_type="RuntimeError")


def _found(conn: psycopg.Connection[Any], job: ClaimedJob) -> dict[str, bool]:
    """Which of the four questions say that ``job``'s lease wrote its outcome."""
    return {"retried": _retried(conn, job) is not None, "failed": _failed(conn, job) is not None,
            "parked": waits.parked_by_lease(conn, job.lease, WAIT) is not None,
            "released": jobq.released_by_lease(conn, job.lease, attempts=job.attempts)}


NONE = {"retried": False, "failed": False, "parked": False, "released": False}


def test_each_write_is_found_done_by_its_own_lease_and_only_as_written(conn):
    _one(conn)
    (a,) = claim_next(conn, "A", now=at(1))
    assert _found(conn, a) == NONE  # running: nothing written yet
    assert jobq.retry(conn, a.lease, error=ERROR, error_type="RuntimeError", backoff_s=600, now=at(2))
    assert _found(conn, a) == {**NONE, "retried": True}
    assert _retried(conn, a) == at(602).timestamp()
    assert jobq.retried_by_lease(conn, a.lease, attempts=a.attempts, error="RuntimeError: another",
                                 error_type="RuntimeError") is None

    _one(conn)
    (b,) = claim_next(conn, "B", now=at(3))
    assert waits.park(conn, b.lease, WAIT, now=at(4)) == "waiting"
    assert _found(conn, b) == {**NONE, "parked": True}
    assert waits.parked_by_lease(conn, b.lease, WaitFor(key="approval-2", cause="approval")) is None

    _one(conn)
    (c,) = claim_next(conn, "C", now=at(5))
    assert jobq.release(conn, c.lease, now=at(6))
    assert _found(conn, c) == {**NONE, "released": True}

    (d,) = claim_next(conn, "D", now=at(7))  # the job given back
    assert d.id == c.id and _found(conn, c) == NONE  # claimed again: a new token
    facts = jobq.fail(conn, d.lease, reason="permanent_error", error=ERROR, error_type="RuntimeError", now=at(8))
    assert facts is not None
    assert _failed(conn, d) == facts
    assert _found(conn, d) == {**NONE, "failed": True}
    assert jobq.failed_by_lease(conn, d.lease, attempts=d.attempts, reason="attempts_exhausted", error=ERROR,
                                error_type="RuntimeError") is None

    waits.activate(conn, WAIT.key or "", now=at(9))
    assert waits.parked_by_lease(conn, b.lease, WAIT) == "queued"  # parked, then activated


def test_the_same_write_by_another_claim_after_a_takeover_is_never_the_old_leases(conn):
    _one(conn)
    (a,) = claim_next(conn, "A", now=at(0), lease_s=10)
    (b,) = claim_next(conn, "A", now=at(11), lease_s=10)  # reaped, then claimed again: even the same worker
    assert (b.token, b.attempts) == (a.token + 1, a.attempts + 1)
    assert jobq.retry(conn, b.lease, error=ERROR, error_type="RuntimeError", backoff_s=0, now=at(12))
    assert _found(conn, a) == NONE
    assert jobq.retried_by_lease(conn, a.lease, attempts=b.attempts, error=ERROR, error_type="RuntimeError") is None
    (c,) = claim_next(conn, "B", now=at(13), lease_s=10)
    assert waits.park(conn, c.lease, WAIT, now=at(14)) == "waiting"
    assert _found(conn, b) == NONE
    waits.resume_job(conn, c.id, now=at(15))
    (d,) = claim_next(conn, "B", now=at(16), lease_s=10)
    assert jobq.fail(conn, d.lease, reason="permanent_error", error=ERROR, error_type="RuntimeError", now=at(17))
    assert _found(conn, c) == NONE and _found(conn, d)["failed"]


def test_the_reapers_requeue_and_dead_letter_of_the_lease_are_not_its_writes(conn):
    _one(conn, max_attempts=2)
    (a,) = claim_next(conn, "A", now=at(0), lease_s=10)
    assert [r.outcome for r in jobq.reap_expired(conn, now=at(11))] == ["requeued"]  # token and owner kept
    assert _found(conn, a) == NONE
    (b,) = claim_next(conn, "A", now=at(12), lease_s=10)
    assert [r.outcome for r in jobq.reap_expired(conn, now=at(23))] == ["failed"]  # attempts used up
    assert _found(conn, b) == NONE
