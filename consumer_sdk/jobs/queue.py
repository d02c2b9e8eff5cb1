"""The job queue in PostgreSQL: enqueue, claim, heartbeat, complete, retry, fail, release.

Every function takes a connection and ``now`` (None in production: the
database clock decides; a fixed time in tests).  Pass connections in autocommit
mode: functions that need several statements open their own short transaction
with ``conn.transaction()``; single statements commit on their own.

Fencing: the writes of a running job take its :class:`~consumer_sdk.jobs.model.Lease`
and match on owner, token, status ``running`` and an unexpired lease.  They
return None (or False) when no row matched: the caller lost its authority and
must write nothing more.  Terminal transitions can write an event about the job
to the outbox in the same transaction (``events_topic``).
"""

from __future__ import annotations

import json
import uuid
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
import psycopg.errors
from psycopg.pq import TransactionStatus

from consumer_sdk import _wire
from consumer_sdk.errors import SchemaMissing
from consumer_sdk.jobs import _check
from consumer_sdk.jobs._db import ConnectionT, from_json, q, to_json, translated
from consumer_sdk.jobs.errors import InvalidJob
from consumer_sdk.jobs.events import EventType, JobFacts, write_job_event
from consumer_sdk.jobs.model import (
    ClaimedJob,
    DeadReason,
    JobId,
    Lane,
    Lease,
    NewJob,
    RunId,
    Take,
    Token,
)
from consumer_sdk.store import pipelined

#: An owner limit this large never binds (the default: no per-owner limit); claims of such
#: owners skip the owners' advisory locks (see claim()).
NO_OWNER_LIMIT = 1_000_000


@dataclass(frozen=True, slots=True)
class Reaped:
    """A job whose lease expired: ``requeued`` (claimable again) or ``failed`` (dead-lettered)."""

    outcome: str
    facts: JobFacts


def check_schema(conn: ConnectionT) -> None:
    """Raise :class:`~consumer_sdk.errors.SchemaMissing` unless the jobs tables exist."""
    with translated():
        row = conn.execute(q("schema_check")).fetchone()
    if not row or not all(row):
        raise SchemaMissing("the jobs schema is missing: run `outbox-relay migrate` (0005_jobs)")


# -- enqueue and claim -----------------------------------------------------------------


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


def ready_lanes(conn: ConnectionT, *, queues: Sequence[str], max_owners: int = 500,
                count_cap: int = 64, now: datetime | None = None) -> list[Lane]:
    """The (queue, owner) lanes with ready work, with each owner's running jobs."""
    params = {"queues": list(queues), "max_owners": max_owners, "count_cap": count_cap, "now": now}
    with translated():
        rows = conn.execute(q("ready_lanes"), params).fetchall()
    return [Lane(queue=r[0], owner_id=r[1], ready=r[2], running=r[3]) for r in rows]


def claim(conn: ConnectionT, *, worker: str, takes: Sequence[Take], lease_s: float,
          now: datetime | None = None) -> list[ClaimedJob]:
    """Claim per ``takes`` in one short transaction; never waits for another claimer.

    Owners whose advisory lock another claimer holds are skipped this time.  The locks
    serialize the count of an owner's running jobs under its limit; when no take has a
    limit that can bind (``owner_limit >= NO_OWNER_LIMIT``), the claim is one statement.
    """
    return complete_and_claim(conn, worker=worker, done=(), takes=takes, lease_s=lease_s, now=now)[1]


def complete_and_claim(conn: ConnectionT, *, worker: str, done: Sequence[Done], takes: Sequence[Take],
                       lease_s: float, now: datetime | None = None
                       ) -> tuple[dict[JobId, JobFacts], list[ClaimedJob]]:
    """:func:`complete_many` and :func:`claim` in the claim's one statement.

    A dispatcher writes the successes its pool collected since the last round and claims
    for the free slots at once: one round trip without an owner limit, else two (the
    owners' locks first), the completions in the claim's transaction.  Returns (the
    completed jobs' facts, the claimed jobs).
    """
    takes = [t for t in takes if t.n > 0]
    if not takes:
        return complete_many(conn, worker=worker, done=done, now=now), []
    if conn.info.transaction_status != TransactionStatus.IDLE:
        raise RuntimeError("jobs.queue.claim() opens its own transaction: call it outside one")
    if all(t.owner_limit >= NO_OWNER_LIMIT for t in takes):
        # No owner limit can bind, so there is no count to serialize: the claim alone, one
        # statement and one round trip (SKIP LOCKED still keeps claimers off each other's rows).
        with translated():
            rows = conn.execute(q("claim"), _claim_params(takes, done, worker, lease_s, now)).fetchall()
        return _split(rows, worker)
    owners = sorted({t.owner_id for t in takes})
    # Two round trips: BEGIN with lock_owners, then claim with COMMIT (pipelines; the claim
    # must be a later statement than the locks, see jobs.sql).
    with translated():
        try:
            with pipelined(conn):
                conn.execute(q("claim_begin"))
                locks = conn.execute(q("lock_owners"), {"owners": owners})
            locked = {r[0] for r in locks.fetchall()}
            mine = [t for t in takes if t.owner_id in locked]
            if not mine and not done:
                conn.rollback()
                return {}, []
            with pipelined(conn):
                claimed = conn.execute(q("claim"), _claim_params(mine, done, worker, lease_s, now))
                conn.execute(q("claim_commit"))
            rows = claimed.fetchall()
        except BaseException:
            if not (conn.closed or conn.broken) and conn.info.transaction_status != TransactionStatus.IDLE:
                try:
                    conn.rollback()
                except psycopg.Error:
                    pass
            raise
    return _split(rows, worker)


def _split(rows: Sequence[Sequence[Any]], worker: str) -> tuple[dict[JobId, JobFacts], list[ClaimedJob]]:
    """The claim's rows: the completed jobs' facts, the claimed jobs."""
    facts: dict[JobId, JobFacts] = {}
    claimed: list[ClaimedJob] = []
    for r in rows:
        if r[0] == "claimed":
            claimed.append(_claimed(r[1:], worker))
        else:
            facts[JobId(r[1])] = JobFacts(job_id=JobId(r[1]), run_id=r[2], queue=r[4], kind=r[5],
                                          attempts=r[7], traceparent=r[10], tracestate=r[11], age_s=r[14])
    return facts, claimed


def _claim_params(takes: Sequence[Take], done: Sequence[Done], worker: str, lease_s: float,
                  now: datetime | None) -> dict[str, Any]:
    return {"takes": json.dumps([[t.queue, t.owner_id, t.n, t.owner_limit] for t in takes if t.n > 0]),
            "done": _done_json(done), "worker": worker, "lease_s": lease_s, "now": now}


def _done_json(done: Sequence[Done]) -> str:
    """[[id, token, result], ...] with each result's JSON text as it is."""
    return "[" + ",".join(f"[{int(d.job_id)},{int(d.token)},{d.result_json}]" for d in done) + "]"


def _claimed(r: Sequence[Any], worker: str) -> ClaimedJob:
    return ClaimedJob(
        id=JobId(r[0]), run_id=None if r[1] is None else RunId(r[1]), owner_id=r[2], queue=r[3],
        kind=r[4], worker=worker, token=Token(r[5]), attempts=r[6], max_attempts=r[7],
        payload=from_json(r[8]), traceparent=r[9], tracestate=r[10], wait_key=r[11],
        activation=from_json(r[12]), created_epoch=r[13])


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


@dataclass(frozen=True, slots=True)
class Done:
    """A success waiting for its completion: the job, the token it ran under, its result
    already encoded as JSON text (see :func:`complete_many`)."""

    job_id: JobId
    token: Token
    result_json: str


def complete_many(conn: ConnectionT, *, worker: str, done: Sequence[Done],
                  now: datetime | None = None) -> dict[JobId, JobFacts]:
    """Mark these jobs succeeded in one statement, each fenced as :func:`complete` is.

    Returns the facts of the jobs completed; a job absent from them lost its lease.
    """
    if not done:
        return {}
    with translated():
        return _done_facts(conn.execute(q("complete_many"), _done_params(done, worker, now)).fetchall())


def _done_params(done: Sequence[Done], worker: str, now: datetime | None) -> dict[str, Any]:
    return {"done": _done_json(done), "worker": worker, "now": now}


def _done_facts(rows: Sequence[Sequence[Any]]) -> dict[JobId, JobFacts]:
    return {JobId(r[0]): JobFacts(job_id=JobId(r[0]), run_id=r[1], queue=r[2], kind=r[3], attempts=r[4],
                                  traceparent=r[5], tracestate=r[6], age_s=r[7]) for r in rows}


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
