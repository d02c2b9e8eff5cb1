"""Accept a run once, read its status, cancel it.

``accept`` stores the run, its first job and (optionally) an outbox event and
the caller's own rows in ONE transaction that it opens and commits itself; it
returns only after the commit, so a run id handed to a client always exists.

Idempotency: ``UNIQUE (owner_id, request_key)`` plus the SHA-256 of the body
(canonical JSON of the kind and the body).  The same key with the same body
returns the existing run (``created=False``); the same key with another body
raises :class:`~consumer_sdk.jobs.errors.RequestKeyConflict`.  Two concurrent
accepts of one key meet on the unique index: the second waits for the first's
commit, then reads its run.

Admission control: with an :class:`~consumer_sdk.jobs.model.AdmissionPolicy`,
``accept`` refuses new work with :class:`~consumer_sdk.jobs.errors.AdmissionRefused`
(carrying ``retry_after_s``) when the queue's backlog exceeds what its workers
do within the horizon.  A repeated request for an existing run is never refused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import structlog
from psycopg.pq import TransactionStatus

from consumer_sdk.errors import DatabaseUnavailable
from consumer_sdk.jobs import _check, _plan, aborted, queue
from consumer_sdk.jobs._db import ConnectionT, from_json, q, to_json, translated
from consumer_sdk.jobs._plan import Plan, event_step, step
from consumer_sdk.jobs.errors import (
    AdmissionRefused,
    InvalidJob,
    RequestKeyConflict,
    RunNotFound,
    TransactionActive,
)
from consumer_sdk.jobs.events import JobFacts, write_job_event
from consumer_sdk.jobs.metrics import JobsMetrics
from consumer_sdk.jobs.model import (
    INTERACTIVE,
    Accepted,
    AdmissionPolicy,
    JobId,
    RunId,
    RunState,
)

_log = structlog.get_logger("consumer_sdk.jobs.runs")

#: Called inside accept's transaction after the run is inserted: write your own rows there.
AcceptHook = Callable[[ConnectionT, Accepted], None]


def body_sha256(kind: str, body: Any) -> bytes:
    """The digest that makes a request key mean one thing: canonical JSON of kind and body."""
    try:
        text = _canonical({"kind": kind, "body": body})
    except TypeError:
        # Keys of several types in one dict ({1: "a", "x": "b"}, which json.dumps writes as
        # strings) cannot be sorted: sort them as the strings stored.  Only then: for every
        # other body the digest stays what it was, so stored runs keep matching their requests.
        try:
            text = _canonical({"kind": kind, "body": json.loads(to_json(body, what="body"))})
        except TypeError as exc:
            raise InvalidJob(f"the body is not JSON-encodable: {exc}") from None
    except ValueError as exc:
        raise InvalidJob(f"the body is not JSON-encodable: {exc}") from None
    except RecursionError:
        raise InvalidJob("the body is nested too deeply to encode as JSON") from None
    return hashlib.sha256(text.encode()).digest()


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def accept(
    conn: ConnectionT,
    *,
    owner_id: str,
    request_key: str,
    kind: str,
    body: Any,
    queue: str = INTERACTIVE,
    max_attempts: int = 5,
    traceparent: str | None = None,
    tracestate: str | None = None,
    admission: AdmissionPolicy | None = None,
    events_topic: str | None = None,
    on_accept: AcceptHook | None = None,
    metrics: JobsMetrics | None = None,
    now: datetime | None = None,
) -> Accepted:
    """Store the run and its job (and a ``run.accepted`` event to ``events_topic``) and commit.

    ``conn`` must not be inside a transaction.  ``on_accept`` runs inside the
    transaction for new runs only; a hook that caught a database error and returned left it
    aborted: nothing is stored, and accept raises what the error stands for
    (:mod:`consumer_sdk.jobs.aborted`: a conflict or a read-only database as when not caught,
    else :class:`~consumer_sdk.errors.HandlerTransactionFailed`).  Raises RequestKeyConflict, AdmissionRefused,
    InvalidJob, TransactionActive.  Every argument is checked before the database is
    touched (:class:`InvalidJob` names the bad one): ``owner_id``, ``request_key`` and
    ``kind`` 1-200 characters without NUL, ``queue`` a queue name, ``max_attempts`` an
    int from 1 to 2**31-1, ``events_topic`` None or a Kafka topic name, ``admission``
    None or an :class:`AdmissionPolicy`, the body JSON that jsonb can store.  A
    malformed ``traceparent`` string is dropped (with ``tracestate``) and logged.
    """
    check_options(admission=admission, events_topic=events_topic, metrics=metrics, on_accept=on_accept)
    request = make_request(owner_id=owner_id, request_key=request_key, kind=kind, body=body, queue=queue,
                           max_attempts=max_attempts, traceparent=traceparent, tracestate=tracestate)
    check_idle(conn)
    with translated(), conn.transaction():
        accepted = _plan.run(conn, accept_plan(request, admission, metrics, now, events_topic))
        if accepted.created and on_accept is not None:
            trips = aborted.watch_hook(conn)  # a hook that caught an error: consumer_sdk/jobs/aborted.py
            on_accept(conn, accepted)
            aborted.check_hook(conn, trips)
    return accepted_done(request, accepted, metrics)


def make_request(*, owner_id: str, request_key: str, kind: str, body: Any, queue: str, max_attempts: int,
                 traceparent: str | None, tracestate: str | None) -> _Request:
    """Validate and encode an accept request (no I/O); shared by the sync and asyncio APIs."""
    _validate(owner_id, request_key, kind, queue, max_attempts)
    traceparent, tracestate = _check.trace(traceparent, tracestate)
    return _Request(owner_id=owner_id, request_key=request_key, kind=kind, queue=queue,
                    goal=to_json(body, what="body"), digest=body_sha256(kind, body),
                    traceparent=traceparent, tracestate=tracestate, max_attempts=max_attempts)


def check_idle(conn: Any, *, asyncio: bool = False) -> None:
    """accept's connection (sync or asyncio): :class:`TransactionActive` inside a transaction;
    :class:`DatabaseUnavailable` when closed or broken, whose status is not idle either and
    read as a transaction left open."""
    _check.connection(conn, asyncio=asyncio)
    status = conn.info.transaction_status
    if status == TransactionStatus.UNKNOWN:
        raise DatabaseUnavailable("database unavailable: the connection is closed or broken")
    if status != TransactionStatus.IDLE:
        raise TransactionActive()


def check_options(*, admission: Any, events_topic: Any, metrics: Any = None, on_accept: Any = None) -> None:
    """accept's options other than the request (shared by the sync and asyncio APIs): all
    before the transaction, where a bad ``metrics`` failed only after the run was committed."""
    if admission is not None and not isinstance(admission, AdmissionPolicy):
        raise InvalidJob(f"admission must be None or an AdmissionPolicy, got {admission!r:.80}")
    _check.topic("events_topic", events_topic)
    if metrics is not None and not isinstance(metrics, JobsMetrics):
        raise InvalidJob(f"metrics must be None or a JobsMetrics, got {metrics!r:.80}")
    if on_accept is not None and not callable(on_accept):
        raise InvalidJob(f"on_accept must be None or a callable, got {on_accept!r:.80}")


def accept_plan(r: _Request, admission: AdmissionPolicy | None, metrics: JobsMetrics | None,
                now: datetime | None, events_topic: str | None) -> Plan[Accepted]:
    """Inside accept's transaction: the existing run, or a refusal, or the new run, job and event."""
    accepted = yield from _store(r, admission, metrics, now)
    if accepted.created and events_topic:
        yield event_step(events_topic, "run.accepted", JobFacts(
            job_id=accepted.job_id, run_id=accepted.run_id, queue=r.queue, kind=r.kind, attempts=0,
            traceparent=r.traceparent, tracestate=r.tracestate))
    return accepted


def accepted_done(r: _Request, accepted: Accepted, metrics: JobsMetrics | None) -> Accepted:
    """After the commit: count and log a new run."""
    if accepted.created:
        if metrics is not None:
            metrics.accepted.labels(r.queue).inc()
        _log.info("run_accepted", run_id=str(accepted.run_id), job_id=accepted.job_id, queue=r.queue,
                  kind=r.kind)
    return accepted


@dataclass(frozen=True, slots=True, kw_only=True)
class _Request:
    owner_id: str
    request_key: str
    kind: str
    queue: str
    goal: str
    digest: bytes
    traceparent: str | None
    tracestate: str | None
    max_attempts: int


def _store(r: _Request, admission: AdmissionPolicy | None,
           metrics: JobsMetrics | None, now: datetime | None) -> Plan[Accepted]:
    """The existing run, or a refusal, or the new run and job."""
    probe = {"owner_id": r.owner_id, "request_key": r.request_key, "queue": r.queue,
             "count_cap": admission.count_cap if admission else 0}
    found = yield step("accept_probe", probe)
    assert found is not None  # the probe always returns one row
    if found[0] is not None:
        return _existing(found, r.digest, r.request_key)
    if admission is not None and admission.refuses(found[4]):
        _refuse(r.queue, admission, found[4], metrics)
    row = yield step("insert_run", {
        "owner_id": r.owner_id, "request_key": r.request_key, "body_sha256": r.digest, "kind": r.kind,
        "queue": r.queue, "goal": r.goal, "traceparent": r.traceparent, "tracestate": r.tracestate,
        "max_attempts": r.max_attempts, "now": now})
    if row is None:  # a concurrent accept of this key committed first: read its run
        winner = yield step("accept_probe", {**probe, "count_cap": 0})
        assert winner is not None and winner[0] is not None
        return _existing(winner, r.digest, r.request_key)
    return Accepted(RunId(row[0]), JobId(row[1]), True, "queued")


def _validate(owner_id: str, request_key: str, kind: str, queue: str, max_attempts: int) -> None:
    """accept's rules; NewJob (enqueue) applies the same ones (:func:`_check.job_fields`)."""
    _check.job_fields(owner_id=owner_id, kind=kind, queue_name=queue, max_attempts=max_attempts)
    _check.text("request_key", request_key)


def _existing(found: Any, digest: bytes, request_key: str) -> Accepted:
    run_id, stored_digest, job_id, status = found[0], bytes(found[1]), found[2], found[3]
    if stored_digest != digest:
        raise RequestKeyConflict(
            f"request key {request_key!r} was already used for run {run_id} with a different body; "
            "use a new key for a new request", run_id=run_id)
    return Accepted(RunId(run_id), JobId(job_id), False, str(status))


def _refuse(queue: str, admission: AdmissionPolicy, pending: int, metrics: JobsMetrics | None) -> None:
    retry_after = admission.retry_after_s(pending)
    if metrics is not None:
        metrics.admission_refused.labels(queue).inc()
    _log.info("run_refused", queue=queue, pending=pending, retry_after_s=retry_after)
    raise AdmissionRefused(
        f"queue {queue!r} holds at least {pending} pending jobs, more than its workers finish in "
        f"{admission.horizon_s:g} s; retry in {retry_after} s",
        queue=queue, retry_after_s=retry_after, pending=pending)


def run_status(conn: ConnectionT, run_id: RunId | str, *, owner_id: str | None = None,
               now: datetime | None = None) -> RunState | None:
    """The run (for ``owner_id`` only, unless None), or None when there is none.

    ``run_id`` must be a ``uuid.UUID`` or a UUID's text and ``owner_id`` None or an
    owner id: anything else (``"not-a-uuid"``, None) raises :class:`InvalidJob` (a
    ``ValueError``; a status endpoint answers 400) before the database is asked; a
    well-formed id of no run (of this owner) returns None (404).
    """
    plan = status_plan(run_id, owner_id, now)  # checks the arguments first
    _check.connection(conn, asyncio=False)
    with translated():
        return _plan.run(conn, plan)


def status_plan(run_id: RunId | str, owner_id: str | None, now: datetime | None) -> Plan[RunState | None]:
    """Check the arguments (now: InvalidJob) and return the plan reading the run."""
    params = {"run_id": _check.run_id(run_id), "owner_id": _owner(owner_id, optional=True), "now": now}
    return _status_plan(params)


def _status_plan(params: Mapping[str, Any]) -> Plan[RunState | None]:
    row = yield step("run_status", params)
    return None if row is None else _state(row)


def _owner(owner_id: Any, *, optional: bool = False) -> str | None:
    if owner_id is None and optional:
        return None
    return _check.text("owner_id", owner_id)


def _state(r: Any) -> RunState:
    return RunState(
        run_id=RunId(r[0]), owner_id=r[1], request_key=r[2], kind=r[3], queue=r[4],
        goal=from_json(r[5]), traceparent=r[6], created_at=r[7], job_id=JobId(r[8]), status=r[9],
        attempts=r[10], max_attempts=r[11], result=from_json(r[12]), last_error=r[13],
        last_error_type=r[14], wait_cause=r[15], wait_key=r[16], finished_at=r[18],
        dead_reason=r[19], available_in_s=float(r[20]))


def cancel_run(conn: ConnectionT, *, owner_id: str, run_id: RunId | str, events_topic: str | None = None,
               metrics: JobsMetrics | None = None, now: datetime | None = None) -> RunState:
    """Cancel the owner's run unless it already ended; returns its state afterwards.

    A worker running it stops at its next heartbeat or write and writes nothing.
    Raises RunNotFound when the owner has no such run, :class:`InvalidJob` (before the
    database is touched) when ``run_id`` is not a UUID, ``owner_id`` not an owner id or
    ``events_topic`` not None or a Kafka topic name.
    """
    params = {"run_id": _check.run_id(run_id), "owner_id": _owner(owner_id), "now": now}
    _check.topic("events_topic", events_topic)
    _check.connection(conn, asyncio=False)
    with translated(), conn.transaction():
        row = conn.execute(q("cancel_run"), params).fetchone()
        if row is not None:
            facts = JobFacts(job_id=JobId(row[0]), queue=row[2], kind=row[3], run_id=row[4],
                             attempts=row[5], traceparent=row[6], tracestate=row[7], age_s=row[8])
            if events_topic:
                write_job_event(conn, events_topic, "job.cancelled", facts)
    if row is not None:
        _log.info("run_cancelled", run_id=str(run_id), previous=row[1])
        if metrics is not None:
            metrics.observe_terminal(row[2], "cancelled", age_s=row[8], attempts=row[5])
    state = run_status(conn, run_id, owner_id=owner_id, now=now)
    if state is None:
        raise RunNotFound(f"no run {run_id} for this owner")
    return state


#: The error classes an owner may see: stable, documented, never exception text.
ERROR_CLASSES = ("permanent_error", "attempts_exhausted", "lease_expired", "retrying")


def error_class(state: RunState) -> str | None:
    """The stable class of the run's last failure (see :data:`ERROR_CLASSES`), or None."""
    if state.dead_reason:
        return state.dead_reason
    if state.last_error or state.last_error_type:
        return "retrying" if state.status != "failed" else "permanent_error"
    return None


def error_reference(state: RunState) -> str:
    """An opaque reference to the run's last error: the admin CLI (``runs show``) and the
    worker's logs (``job_id``, ``attempt``) lead from it to the raw text."""
    return f"err-{state.job_id}-{state.attempts}"


def owner_view(state: RunState) -> Mapping[str, Any]:
    """A JSON-ready view of a run for its owner (what a status endpoint returns).

    A failure shows as ``error: {"class": ..., "reference": ...}``: a stable class and
    a reference for support, never the raw error text (it can hold internal URLs or
    tokens); that stays in :func:`run_status` and the admin CLI."""
    view: dict[str, Any] = {
        "run_id": str(state.run_id), "status": state.status, "kind": state.kind,
        "queue": state.queue, "attempts": state.attempts, "created_at": state.created_at.isoformat(),
        "finished_at": state.finished_at.isoformat() if state.finished_at else None,
    }
    if state.status == "succeeded":
        view["result"] = state.result
    if state.status == "waiting":
        view["waiting_for"] = state.wait_cause
    kind = error_class(state) if state.status in ("failed", "queued") else None
    if kind is not None:
        view["error"] = {"class": kind, "reference": error_reference(state)}
    if state.dead_reason:
        view["failure_reason"] = state.dead_reason
    return view


def results(conn: ConnectionT, job_id: JobId) -> dict[str, Any]:
    """A job's results by key (what its attempts wrote with ``JobContext.put_result``), its
    arguments checked first: a job id that is no bigint was PostgreSQL's FatalError."""
    job = JobId(_check.integer("job_id", job_id, 1, 2**63 - 1))
    _check.connection(conn, asyncio=False)
    return queue.results(conn, job)
