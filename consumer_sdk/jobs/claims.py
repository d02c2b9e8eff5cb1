"""The dispatcher's statements: the ready lanes, and one round's completions and claims.

A worker pool's dispatcher lists the (queue, owner) lanes with ready work
(:func:`ready_lanes`, a window of at most ``max_owners`` owners per queue that starts
after the owner it served last and wraps around), plans, then writes the successes its
pool collected since the last round and claims in one statement
(:func:`complete_and_claim`).  Every completion is fenced (owner, token, running,
unexpired lease).  A completion sent again because the reply to the statement that
carried it was lost (:func:`complete_many` with ``recheck``) is found written by the same
lease and reported as ``confirmed``, not as a lost lease.  :mod:`consumer_sdk.jobs.queue`
re-exports these.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from consumer_sdk.jobs._db import ConnectionT, from_json, q, translated
from consumer_sdk.jobs.events import JobFacts
from consumer_sdk.jobs.model import ClaimedJob, JobId, Lane, RunId, Take, Token
from consumer_sdk.store import pipelined

#: An owner limit this large never binds (the default: no per-owner limit); claims of such
#: owners skip the owners' advisory locks (see claim()).
NO_OWNER_LIMIT = 1_000_000
#: The payload bytes a worker pool holds at once by default (WorkerConfig.max_payload_bytes),
#: and a claim's byte budget by default: the job that crosses it is taken (``claim`` in jobs.sql).
DEFAULT_MAX_PAYLOAD_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Done:
    """A success waiting for its completion: the job, the token it ran under, its result
    already encoded as JSON text (see :func:`complete_many`)."""

    job_id: JobId
    token: Token
    result_json: str


class Written(dict[JobId, JobFacts]):
    """The facts of the jobs a write completed, by job id; ``confirmed`` holds those an
    earlier statement of the same lease had completed already (:func:`complete_many` with
    ``recheck``: that statement's reply was lost).  A job of the write absent from it lost
    its lease."""

    confirmed: frozenset[JobId] = frozenset()


def ready_lanes(conn: ConnectionT, *, queues: Sequence[str], max_owners: int = 500,
                count_cap: int = 64, now: datetime | None = None,
                after: Mapping[str, str] | None = None) -> list[Lane]:
    """The (queue, owner) lanes with ready work, with each owner's running jobs: at most
    ``max_owners`` owners per queue, from the first owner after ``after[queue]`` (the last
    one served; absent: the first owner), wrapping around.  In that order per queue."""
    after = after or {}
    params = {"queues": list(queues), "after": [after.get(queue) for queue in queues],
              "max_owners": max_owners, "count_cap": count_cap, "now": now}
    with translated():
        rows = conn.execute(q("ready_lanes"), params).fetchall()
    return [Lane(queue=r[0], owner_id=r[1], ready=r[2], running=r[3]) for r in rows]


def claim(conn: ConnectionT, *, worker: str, takes: Sequence[Take], lease_s: float,
          now: datetime | None = None, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> list[ClaimedJob]:
    """Claim per ``takes`` in one short transaction; never waits for another claimer.

    Owners whose advisory lock another claimer holds are skipped this time.  The locks
    serialize the count of an owner's running jobs under its limit; when no take has a
    limit that can bind (``owner_limit >= NO_OWNER_LIMIT``), the claim is one statement.
    The jobs' payloads stop the claim at ``max_bytes`` (at least 1): jobs are taken in the
    order of ``takes`` (queues by priority, then one job of each take per turn) up to the one
    that crosses it, that one included, so the first always is (a job over the budget still
    runs).  Each claimed job says its size as counted (``payload_bytes``).
    """
    return complete_and_claim(conn, worker=worker, done=(), takes=takes, lease_s=lease_s, now=now,
                              max_bytes=max_bytes)[1]


def complete_and_claim(conn: ConnectionT, *, worker: str, done: Sequence[Done], takes: Sequence[Take],
                       lease_s: float, now: datetime | None = None,
                       max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> tuple[Written, list[ClaimedJob]]:
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
    params = _claim_params(takes, done, worker, lease_s, now, max_bytes=max_bytes)
    if all(t.owner_limit >= NO_OWNER_LIMIT for t in takes):
        # No owner limit can bind, so there is no count to serialize: the claim alone, one
        # statement and one round trip (SKIP LOCKED still keeps claimers off each other's rows).
        with translated():
            return _split(conn.execute(q("claim"), params).fetchall(), worker)
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
                return Written(), []
            with pipelined(conn):
                claimed = conn.execute(q("claim"), {**params, "takes": _takes_json(mine)})
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


def release_unheld(conn: ConnectionT, *, worker: str, held: Sequence[JobId],
                   now: datetime | None = None) -> list[JobId]:
    """After a claim of ``worker`` whose reply was lost: give back the jobs running under
    ``worker`` that its pool does not hold (``held``: every attempt it holds), claimed by
    that claim and run by no one; their attempt is not counted.  Returns their ids."""
    with translated():
        rows = conn.execute(q("release_unheld"), {"worker": worker, "held": [int(i) for i in held],
                                                  "now": now}).fetchall()
    return [JobId(r[0]) for r in rows]


def complete_many(conn: ConnectionT, *, worker: str, done: Sequence[Done],
                  now: datetime | None = None, recheck: bool = False) -> Written:
    """Mark these jobs succeeded in one statement, each fenced as
    :func:`~consumer_sdk.jobs.queue.complete` is.

    Returns the facts of the jobs completed; a job absent from them lost its lease.  With
    ``recheck`` (these completions were sent before, and the reply was lost), the jobs it did
    not find running are looked for completed by their lease (``completed_by_lease``: a
    statement more, so only then): those are returned too, in ``confirmed``.
    """
    if not done:
        return Written()
    with translated():
        written = _written([("done", *r) for r in conn.execute(q("complete_many"),
                                                                 _done_params(done, worker, now)).fetchall()])
    missing = [(d.job_id, d.token) for d in done if d.job_id not in written] if recheck else []
    if missing:
        found = completed_by_lease(conn, worker=worker, leases=missing)
        written.update(found)
        written.confirmed = found.confirmed
    return written


def completed_by_lease(conn: ConnectionT, *, worker: str, leases: Sequence[tuple[JobId, Token]]) -> Written:
    """Which of these (job id, lease token) an earlier statement of ``worker`` completed: the
    reply to the statement that carried them was lost, and written again they matched no row.
    Their facts, all in ``confirmed``; a job absent from them lost its lease."""
    pairs = json.dumps([[int(job_id), int(token)] for job_id, token in leases])
    with translated():
        return _written([("confirmed", *r) for r in conn.execute(
            q("completed_by_lease"), {"done": pairs, "worker": worker}).fetchall()])


def _done_params(done: Sequence[Done], worker: str, now: datetime | None) -> dict[str, Any]:
    return {"done": _done_json(done), "worker": worker, "now": now}


def _split(rows: Sequence[Sequence[Any]], worker: str) -> tuple[Written, list[ClaimedJob]]:
    """The claim's rows: the completed jobs' facts, the claimed jobs."""
    claimed = [_claimed(r[1:], worker) for r in rows if r[0] == "claimed"]
    return _written([(r[0], r[1], r[2], r[4], r[5], r[7], r[10], r[11], r[14]) for r in rows
                     if r[0] != "claimed"]), claimed


def _written(rows: Sequence[Sequence[Any]]) -> Written:
    """Rows of (what, id, run_id, queue, kind, attempts, traceparent, tracestate, age_s)."""
    written = Written({JobId(r[1]): JobFacts(job_id=JobId(r[1]), run_id=r[2], queue=r[3], kind=r[4],
                                             attempts=r[5], traceparent=r[6], tracestate=r[7], age_s=r[8])
                       for r in rows})
    written.confirmed = frozenset(JobId(r[1]) for r in rows if r[0] == "confirmed")
    return written


def _claim_params(takes: Sequence[Take], done: Sequence[Done], worker: str, lease_s: float,
                  now: datetime | None, *, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> dict[str, Any]:
    return {"takes": _takes_json(takes), "done": _done_json(done), "worker": worker, "lease_s": lease_s,
            "now": now, "budget_bytes": max_bytes}


def _takes_json(takes: Sequence[Take]) -> str:
    return json.dumps([[t.queue, t.owner_id, t.n, t.owner_limit] for t in takes if t.n > 0])


def _done_json(done: Sequence[Done]) -> str:
    """[[id, token, result], ...] with each result's JSON text as it is."""
    return "[" + ",".join(f"[{int(d.job_id)},{int(d.token)},{d.result_json}]" for d in done) + "]"


def _claimed(r: Sequence[Any], worker: str) -> ClaimedJob:
    return ClaimedJob(
        id=JobId(r[0]), run_id=None if r[1] is None else RunId(r[1]), owner_id=r[2], queue=r[3],
        kind=r[4], worker=worker, token=Token(r[5]), attempts=r[6], max_attempts=r[7],
        payload=from_json(r[8]), traceparent=r[9], tracestate=r[10], wait_key=r[11],
        activation=from_json(r[12]), created_epoch=r[13], payload_bytes=r[14])
