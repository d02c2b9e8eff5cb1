"""Waiting without holding a worker: park, activate, resume, and the reconciler's query.

A handler parks its job in ``waiting`` with a cause and a resume condition (an
activation key, a timeout, or both) and the worker is free.  An activation is
the durable record that the awaited fact arrived (an event, an API call): one
row per key in ``job_activations``, written once however often it is
delivered, which resumes the jobs waiting on the key.  The activation is a
signal, not the data; the handler reads what it needs when it runs again.

Races, and why none loses or doubles an advance:

* activation before park: ``park`` finds the key recorded and queues the job at once;
* activation during park: both take the key's advisory lock (``activation_lock``)
  before their main statement, so the second one sees the first one's commit;
* activation lost (its transaction committed but no worker was woken, or a
  process died in between): the reconciler's ``resume_ready`` finds a waiting
  job whose key is recorded and queues it;
* duplicated activation: the key is already recorded and nothing waits on it
  any more, so it changes nothing; every resume is conditioned on ``waiting``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from consumer_sdk.jobs._db import ConnectionT, q, to_json, translated
from consumer_sdk.jobs.errors import InvalidJob
from consumer_sdk.jobs.model import Activation, JobId, Lease, WaitFor

MAX_KEY_CHARS = 500


def park(conn: ConnectionT, lease: Lease, wait: WaitFor, *, now: datetime | None = None) -> str | None:
    """Park the running job; returns ``waiting``, ``queued`` (already activated) or None (lease lost)."""
    _check_key(wait.key)
    params = {"id": lease.job_id, "worker": lease.worker, "token": lease.token, "now": now,
              "key": wait.key, "cause": wait.cause, "timeout_s": wait.timeout_s}
    with translated(), conn.transaction():
        if wait.key is not None:
            conn.execute(q("activation_lock"), {"key": wait.key})
        row = conn.execute(q("park"), params).fetchone()
    return None if row is None else str(row[0])


def activate(conn: ConnectionT, key: str, payload: Any = None, *,
             now: datetime | None = None) -> Activation:
    """Record the activation ``key`` (once) and resume the jobs waiting on it.

    Runs in the caller's transaction when one is open (as a savepoint), e.g. the
    dedup consumer's, so an activation carried by a Kafka event is recorded
    exactly once with the event's inbox row; otherwise in its own transaction.
    """
    _check_key(key)
    with translated(), conn.transaction():
        conn.execute(q("activation_lock"), {"key": key})
        row = conn.execute(q("activate"), {"key": key, "now": now,
                                           "payload": to_json(payload, what="activation payload")})
        found = row.fetchone()
    if found is None:  # pragma: no cover - the statement always returns one row
        return Activation(False, ())
    return Activation(bool(found[0]), tuple(JobId(i) for i in found[1]))


def resume_job(conn: ConnectionT, job_id: JobId, *, now: datetime | None = None) -> bool:
    """Resume one waiting job by id (an API call); False when it was not waiting."""
    with translated():
        return conn.execute(q("resume_job"), {"id": job_id, "now": now}).fetchone() is not None


def resume_ready(conn: ConnectionT, *, limit: int = 500,
                 now: datetime | None = None) -> list[tuple[JobId, str, bool]]:
    """The reconciler's pass: ``(job_id, queue, activated)`` of each job it resumed.

    ``activated`` is True when an activation was recorded (its wake-up was lost),
    False when the job's timeout passed.
    """
    with translated():
        rows = conn.execute(q("resume_ready"), {"limit": limit, "now": now}).fetchall()
    return [(JobId(r[0]), str(r[1]), bool(r[2])) for r in rows]


def _check_key(key: str | None) -> None:
    if key is not None and not (isinstance(key, str) and 0 < len(key) <= MAX_KEY_CHARS):
        raise InvalidJob(f"an activation key is a non-empty string of at most {MAX_KEY_CHARS} characters")
