"""The job queue in PostgreSQL: enqueue, claim, heartbeat, complete, retry, fail, release.

The dispatcher's claim path (ready lanes, one round's completions and claims) lives in
:mod:`consumer_sdk.jobs.claims` and is re-exported here.

Every function takes a connection and ``now`` (None in production: the
database clock decides; a fixed time in tests).  Pass connections in autocommit
mode: functions that need several statements open their own short transaction
with ``conn.transaction()``; single statements commit on their own.

Fencing: the writes of a running job take its :class:`~consumer_sdk.jobs.model.Lease`
and match on owner, token, status ``running`` and an unexpired lease.  They
return None (or False) when no row matched: the caller lost its authority and
must write nothing more.  Terminal transitions can write an event about the job
to the outbox in the same transaction (``events_topic``).  When the reply to such a
write was lost and, sent again, it matched no row, the ``*_by_lease`` questions say
whether the first one committed: the row as that lease's write leaves it, under its token
(see :mod:`consumer_sdk.jobs.executor`).
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg.errors

from consumer_sdk import _wire
from consumer_sdk.errors import SchemaMissing
from consumer_sdk.jobs import _check
from consumer_sdk.jobs._db import ConnectionT, from_json, q, to_json, translated

# The claim path, re-exported: this module has every write of the jobs.
from consumer_sdk.jobs.claims import NO_OWNER_LIMIT as NO_OWNER_LIMIT
from consumer_sdk.jobs.claims import Done as Done
from consumer_sdk.jobs.claims import claim as claim
from consumer_sdk.jobs.claims import complete_and_claim as complete_and_claim
from consumer_sdk.jobs.claims import complete_many as complete_many
from consumer_sdk.jobs.claims import completed_by_lease as completed_by_lease
from consumer_sdk.jobs.claims import ready_lanes as ready_lanes
from consumer_sdk.jobs.errors import InvalidJob
from consumer_sdk.jobs.events import EventType, JobFacts, write_job_event
from consumer_sdk.jobs.model import DeadReason, JobId, Lease, NewJob
from consumer_sdk.store import pipelined


@dataclass(frozen=True, slots=True)
class Reaped:
    """A job whose lease expired: ``requeued`` (claimable again) or ``failed`` (dead-lettered)."""

    outcome: str
    facts: JobFacts


def check_schema(conn: ConnectionT) -> None:
    """Raise :class:`~consumer_sdk.errors.SchemaMissing` unless the jobs tables exist (the
    database's words name the first one missing)."""
    with translated():
        row = conn.execute(q("schema_check")).fetchone()
    if not row or not all(row):
        raise SchemaMissing("the jobs schema is missing: run `outbox-relay migrate` (0005_jobs)")


# -- enqueue and reap (the claim path: consumer_sdk.jobs.claims) ---------------------------


def enqueue(conn: ConnectionT, jobs: Iterable[NewJob], *, now: datetime | None = None) -> list[JobId]:
    """Insert standalone jobs in one statement (the caller's transaction, if one is open).

    ``jobs`` is any iterable of :class:`NewJob` (read once), each checked when built (accept's
    rules); the payloads are encoded here (InvalidJob when jsonb cannot store them)."""
    # Read once: a generator checked by all() was empty by the insert (nothing written).
    listed = list(jobs) if isinstance(jobs, Iterable) and not isinstance(jobs, (str, bytes)) else [jobs]
    if not all(isinstance(j, NewJob) for j in listed):
        raise InvalidJob(f"jobs must be an iterable of NewJob, got {jobs!r:.80}")
    jobs = listed
    _check.connection(conn, asyncio=False)
    if not jobs:
        return []
    params: dict[str, Any] = {
        "owners": [j.owner_id for j in jobs], "queues": [j.queue for j in jobs],
        "kinds": [j.kind for j in jobs],
        "payloads": [to_json(j.payload, what="job payload") for j in jobs],
        "max_attempts": [j.max_attempts for j in jobs], "delays_s": [j.delay_s for j in jobs],
        "traceparents": [j.traceparent for j in jobs], "tracestates": [j.tracestate for j in jobs],
        "now": now,
    }
    with translated():
        return [JobId(r[0]) for r in conn.execute(q("enqueue"), params).fetchall()]


def reap_expired(conn: ConnectionT, *, limit: int = 500, now: datetime | None = None,
                 events_topic: str | None = None) -> list[Reaped]:
    """Requeue (or, attempts used up, fail and dead-letter) jobs whose lease expired."""
    with translated(), conn.transaction():
        rows = conn.execute(q("reap_expired"), {"limit": limit, "now": now}).fetchall()
        reaped = [Reaped(r[0], JobFacts(job_id=JobId(r[1]), queue=r[2], run_id=r[3], kind=r[4] or "",
                                        attempts=r[5] or 0, traceparent=r[6], tracestate=r[7],
                                        age_s=r[8]))
                  for r in rows]
        if events_topic:
            for item in reaped:
                if item.outcome == "failed":
                    write_job_event(conn, events_topic, "job.failed", item.facts)
    return reaped


# -- a running job's writes (fenced) ---------------------------------------------------


def heartbeat(conn: ConnectionT, *, worker: str, leases: Sequence[Lease], lease_s: float,
              now: datetime | None = None) -> dict[JobId, str | None]:
    """Renew these leases in one statement.

    Returns, for each lease NOT renewed, the job's status (``cancelled``, ``queued``
    after a takeover... or None when the row is gone); renewed ones are absent, and so
    are jobs this same lease already completed (nothing was lost: the completion won the
    race with this heartbeat).
    """
    if not leases:
        return {}
    params = {"ids": [lease.job_id for lease in leases], "tokens": [lease.token for lease in leases],
              "worker": worker, "lease_s": lease_s, "now": now}
    with translated():
        rows = conn.execute(q("heartbeat"), params).fetchall()
    return {JobId(r[0]): r[2] for r in rows if not r[1]}


def holds(conn: ConnectionT, lease: Lease, *, now: datetime | None = None) -> bool:
    """In an open transaction: lock the job row FOR KEY SHARE if ``lease`` still holds it.

    The first statement of a fenced transaction (see ``fenced_lock`` in jobs.sql).
    """
    params = {"id": lease.job_id, "worker": lease.worker, "token": lease.token, "now": now}
    return conn.execute(q("fenced_lock"), params).fetchone() is not None


def holds_later(conn: ConnectionT, lease: Lease, *, now: datetime | None = None) -> Any:
    """:func:`holds`, sent in the caller's pipeline: returns the cursor whose one row (or none)
    says so once the pipeline is synced."""
    params = {"id": lease.job_id, "worker": lease.worker, "token": lease.token, "now": now}
    return conn.execute(q("fenced_lock"), params)


def fence_begin(conn: ConnectionT, lease: Lease, *, now: datetime | None = None) -> bool:
    """BEGIN and :func:`holds` in one round trip; True when ``lease`` holds the job.

    Either way a transaction is left open (the caller commits or rolls it back).  BEGIN
    and the connection's prepared copy of ``fenced_lock`` go in one libpq pipeline
    (:mod:`consumer_sdk._wire`: the least client CPU, no planning on the server);
    the first call on a connection prepares it (one round trip more, once).  Where it
    cannot be kept prepared (a pooler that moves sessions between servers) or libpq has
    no pipeline mode, BEGIN and ``fenced_lock`` go through psycopg.  Driver errors are
    raised as they are: the caller translates them.
    """
    if not _wire.available(conn):
        return _fence_begin_pipelined(conn, lease, now=now)
    params = [b"%d" % lease.job_id, b"%d" % lease.token, None if now is None else now.isoformat().encode()]
    for _attempt in range(2):
        if conn not in _FENCE_PREPARED:
            _prepare_fence(conn)
        try:
            return _wire.begin_and_execute(conn, _wire.BEGIN, FENCE_STATEMENT, params) > 0
        except psycopg.errors.InvalidSqlStatementName:  # DISCARD ALL, or another server session
            conn.rollback()  # BEGIN went through: leave the aborted transaction
            _FENCE_PREPARED.discard(conn)
    return _fence_begin_pipelined(conn, lease, now=now)


def _fence_begin_pipelined(conn: ConnectionT, lease: Lease, *, now: datetime | None) -> bool:
    with pipelined(conn):
        conn.execute(q("fenced_begin"))
        held = holds_later(conn, lease, now=now)
    return held.fetchone() is not None


#: Connections known to hold the prepared fence (see fence_begin).
_FENCE_PREPARED: weakref.WeakSet[ConnectionT] = weakref.WeakSet()
#: The prepared fence's name, as ``fence_prepare`` in jobs.sql creates it.
FENCE_STATEMENT = b"outbox_jobs_fence_v2"


def _prepare_fence(conn: ConnectionT) -> None:
    _wire.prepare(conn, q("fence_prepare").encode())
    _FENCE_PREPARED.add(conn)


def put_result(conn: ConnectionT, lease: Lease, key: str, value: Any, *,
               now: datetime | None = None) -> None:
    """Upsert one result by key; call it inside a fenced transaction."""
    conn.execute(*put_result_statement(lease, key, value, now=now))


def put_result_statement(lease: Lease, key: str, value: Any, *,
                         now: datetime | None = None) -> tuple[str, dict[str, Any]]:
    """:func:`put_result`'s statement and parameters (for :func:`fenced_execute`)."""
    return q("put_result"), {"id": lease.job_id, "key": key, "token": lease.token,
                             "value": to_json(value, what="result"), "now": now}


def results(conn: ConnectionT, job_id: JobId) -> dict[str, Any]:
    """A job's results by key (JobContext.results; the checked API is runs.results)."""
    with translated():
        return {r[0]: from_json(r[1]) for r in conn.execute(q("results"), {"id": job_id}).fetchall()}


def complete(conn: ConnectionT, lease: Lease, *, result: Any = None, now: datetime | None = None,
             events_topic: str | None = None, result_json: str | None = None) -> JobFacts | None:
    """Mark the job succeeded with ``result`` (or ``result_json``, already encoded); None when
    the lease was lost."""
    encoded = result_json if result_json is not None else to_json(result, what="result")
    params = {**_fence(lease, now), "result": encoded}
    return _terminal(conn, "complete", params, lease.job_id, "job.succeeded", events_topic)


def fail(conn: ConnectionT, lease: Lease, *, reason: DeadReason, error: str, error_type: str | None,
         now: datetime | None = None, events_topic: str | None = None) -> JobFacts | None:
    """Mark the job failed and write its dead letter, in one statement; None when the lease was lost."""
    params = {**_fence(lease, now), "reason": reason, "error": error, "error_type": error_type}
    return _terminal(conn, "fail", params, lease.job_id, "job.failed", events_topic)


def retry(conn: ConnectionT, lease: Lease, *, error: str, error_type: str | None, backoff_s: float,
          now: datetime | None = None) -> float | None:
    """Queue the job again after ``backoff_s``; returns when it is due (epoch seconds) or None when lost."""
    params = {**_fence(lease, now), "error": error, "error_type": error_type, "backoff_s": backoff_s}
    with translated():
        row = conn.execute(q("retry"), params).fetchone()
    return None if row is None else float(row[6])


def release(conn: ConnectionT, lease: Lease, *, now: datetime | None = None) -> bool:
    """Give a job back (the pool is stopping): claimable at once, the attempt not counted."""
    with translated():
        return conn.execute(q("release"), _fence(lease, now)).fetchone() is not None


@dataclass(frozen=True, slots=True)
class GivenBack:
    """What :func:`give_back` found: the job's interruptions (migration 0017) and,
    among them, its conflicts and read-only ones (0018; the rest: the connection broke),
    whether it was given back, and in how many seconds it is due (0 when not given back)."""

    interruptions: int
    given: bool
    conflicts: int = 0
    read_only: int = 0
    due_in_s: float = 0.0


def give_back(conn: ConnectionT, lease: Lease, *, cause: str, error: str, error_type: str | None,
              delay_s: float, max_interruptions: int, growth: float = 1.0, max_delay_s: float | None = None,
              now: datetime | None = None) -> GivenBack | None:
    """Give back a job whose attempt failed through no fault of its own (``cause``:
    ``connection_broke``, ``conflict`` or ``read_only``; migrations 0017 and 0018): due again
    after ``delay_s`` (times ``growth`` for each read-only interruption it already had, at most
    ``max_delay_s``), the attempt not counted, the interruption counted, unless the job's
    interruptions already reached ``max_interruptions`` (then nothing is written).  None when
    the lease was lost."""
    params = {**_fence(lease, now), "cause": cause, "error": error, "error_type": error_type, "delay_s": delay_s,
              "growth": growth, "max_delay_s": delay_s if max_delay_s is None else max_delay_s,
              "max_interruptions": max_interruptions}
    with translated():
        row = conn.execute(q("give_back_interrupted"), params).fetchone()
    return None if row is None else _given_back(row)


def _given_back(row: Sequence[Any]) -> GivenBack:
    return GivenBack(interruptions=int(row[0]), given=bool(row[1]), conflicts=int(row[2]), read_only=int(row[3]),
                     due_in_s=float(row[4] or 0.0))


# -- after a lost reply: did this lease's write commit? (see the executor) ---------------


def retried_by_lease(conn: ConnectionT, lease: Lease, *, attempts: int, error: str,
                     error_type: str | None) -> float | None:
    """When the job is due (epoch seconds) if an earlier :func:`retry` of ``lease`` (attempt
    number ``attempts``, this error) committed, else None: its reply was lost, and sent
    again it matched no row.  A write of another claim never matches (its token differs)."""
    row = _by_lease(conn, "retried_by_lease", lease, attempts=attempts, error=error, error_type=error_type)
    return None if row is None else float(row[0])


def failed_by_lease(conn: ConnectionT, lease: Lease, *, attempts: int, reason: DeadReason, error: str,
                    error_type: str | None) -> JobFacts | None:
    """:func:`retried_by_lease` for :func:`fail`: the job's facts if that failure and its dead
    letter committed (its event too, in the same transaction), else None."""
    return _facts(lease.job_id, _by_lease(conn, "failed_by_lease", lease, attempts=attempts, reason=reason,
                                          error=error, error_type=error_type))


def released_by_lease(conn: ConnectionT, lease: Lease, *, attempts: int) -> bool:
    """:func:`retried_by_lease` for :func:`release` (``attempts``: the claim's count)."""
    return _by_lease(conn, "released_by_lease", lease, attempts=attempts) is not None


def found_given_back(conn: ConnectionT, lease: Lease, *, attempts: int, error: str, error_type: str | None,
                     now: datetime | None = None) -> GivenBack | None:
    """:func:`retried_by_lease` for :func:`give_back` (``attempts``: the claim's count): what it
    returns had it given the job back, else None."""
    row = _by_lease(conn, "given_back_by_lease", lease, attempts=attempts, error=error, error_type=error_type,
                    now=now)
    return None if row is None else _given_back(row)


def _by_lease(conn: ConnectionT, name: str, lease: Lease, **params: Any) -> Sequence[Any] | None:
    with translated():
        row: Sequence[Any] | None = conn.execute(
            q(name), {"id": lease.job_id, "worker": lease.worker, "token": lease.token, **params}).fetchone()
    return row


def _fence(lease: Lease, now: datetime | None) -> dict[str, Any]:
    return {"id": lease.job_id, "worker": lease.worker, "token": lease.token, "now": now}


def _terminal(conn: ConnectionT, name: str, params: dict[str, Any], job_id: JobId,
              event_type: EventType, events_topic: str | None) -> JobFacts | None:
    if not events_topic:  # one statement: no transaction block (two round trips fewer)
        with translated():
            return _facts(job_id, conn.execute(q(name), params).fetchone())
    with translated(), conn.transaction():
        facts = _facts(job_id, conn.execute(q(name), params).fetchone())
        if facts is not None:
            write_job_event(conn, events_topic, event_type, facts)
    return facts


def _facts(job_id: JobId, row: Sequence[Any] | None) -> JobFacts | None:
    if row is None:
        return None
    return JobFacts(job_id=job_id, queue=row[0], kind=row[1], run_id=row[2], attempts=row[3],
                    traceparent=row[4], tracestate=row[5], age_s=row[6])


def new_worker_id(prefix: str = "worker") -> str:
    """A worker identity unique to this process run: a restart never reuses an old lease owner."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"
