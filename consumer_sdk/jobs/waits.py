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

from consumer_sdk.jobs import _check, _plan
from consumer_sdk.jobs._db import ConnectionT, q, to_json, translated
from consumer_sdk.jobs._plan import Plan, event_step, step
from consumer_sdk.jobs.events import JobFacts, write_job_event
from consumer_sdk.jobs.model import MAX_KEY_CHARS as MAX_KEY_CHARS
from consumer_sdk.jobs.model import Activation, JobId, Lease, WaitFor


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


def parked_by_lease(conn: ConnectionT, lease: Lease, wait: WaitFor) -> str | None:
    """The job's status (``waiting``, or ``queued`` once activated) if an earlier :func:`park`
    of ``lease`` with this ``wait`` committed, else None: its reply was lost, and sent again
    it matched no row.  A write of another claim never matches (its token differs)."""
    params = {"id": lease.job_id, "worker": lease.worker, "token": lease.token, "key": wait.key,
              "cause": wait.cause}
    with translated():
        row = conn.execute(q("parked_by_lease"), params).fetchone()
    return None if row is None else str(row[0])


def activate(conn: ConnectionT, key: str, payload: Any = None, *, now: datetime | None = None,
             events_topic: str | None = None) -> Activation:
    """Record the activation ``key`` (once) and resume the jobs waiting on it.

    Runs in the caller's transaction when one is open (as a savepoint), e.g. the
    dedup consumer's, so an activation carried by a Kafka event is recorded
    exactly once with the event's inbox row; otherwise in its own transaction.
    Workers learn of the resumed jobs after the commit: from NOTIFY (the jobs
    trigger), from a ``job.resumed`` event to ``events_topic`` once relayed, or
    from their poll.
    """
    plan = activate_plan(key, payload, now, events_topic)  # checks the arguments first
    _check.connection(conn, asyncio=False)
    with translated(), conn.transaction():
        return _plan.run(conn, plan)


def activate_plan(key: str, payload: Any, now: datetime | None, events_topic: str | None) -> Plan[Activation]:
    """Check the arguments (now: InvalidJob) and return the statements of :func:`activate`
    (shared with its asyncio twin)."""
    _check_key(key)
    encoded = to_json(payload, what="activation payload")
    _check.topic("events_topic", events_topic)
    return _activate_plan(key, encoded, now, events_topic)


def _activate_plan(key: str, encoded: str, now: datetime | None, events_topic: str | None) -> Plan[Activation]:
    yield step("activation_lock", {"key": key}, "none")
    rows = yield step("activate", {"key": key, "now": now, "payload": encoded}, "all")
    resumed = [_facts(r[1:]) for r in rows if r[1] is not None]
    if events_topic:
        for facts in resumed:
            yield event_step(events_topic, "job.resumed", facts)
    return Activation(bool(rows and rows[0][0]), tuple(f.job_id for f in resumed))


def resume_job(conn: ConnectionT, job_id: JobId, *, now: datetime | None = None) -> bool:
    """Resume one waiting job by id (an API call); False when it was not waiting."""
    params = {"id": _check.integer("job_id", job_id, 1, 2**63 - 1), "now": now}
    _check.connection(conn, asyncio=False)
    with translated():
        return conn.execute(q("resume_job"), params).fetchone() is not None


def resume_ready(conn: ConnectionT, *, limit: int = 500, now: datetime | None = None,
                 events_topic: str | None = None) -> list[tuple[JobFacts, bool]]:
    """The reconciler's pass: each job it resumed, and whether an activation was recorded
    (True: its wake-up was lost) or its timeout passed (False)."""
    with translated(), conn.transaction():
        rows = conn.execute(q("resume_ready"), {"limit": limit, "now": now}).fetchall()
        resumed = [(_facts((r[0], r[1], *r[3:])), bool(r[2])) for r in rows]
        if events_topic:
            for facts, _activated in resumed:
                write_job_event(conn, events_topic, "job.resumed", facts)
    return resumed


def _facts(r: Any) -> JobFacts:
    """(id, queue, run_id, kind, attempts, traceparent, tracestate) -> JobFacts."""
    return JobFacts(job_id=JobId(r[0]), queue=r[1], run_id=r[2], kind=r[3], attempts=r[4],
                    traceparent=r[5], tracestate=r[6])


def _check_key(key: str | None) -> None:
    if key is not None:
        _check.text("the activation key", key, max_chars=MAX_KEY_CHARS)
