"""Events about runs and jobs, written to the outbox in the transaction of the change they announce.

Every event carries the run's trace context (``traceparent``/``tracestate``
headers) and the job's queue in the ``jobs_queue`` header, the hint a worker
pool's wake-up handler reads (see :mod:`consumer_sdk.jobs.wake`).  The key is
the run id (the job id for a standalone job), so the events of one run keep
their order in Kafka.  Payload::

    {"type": "run.accepted" | "job.resumed" | "job.succeeded" | "job.failed" | "job.cancelled",
     "run_id": "...", "job_id": 17, "queue": "interactive", "kind": "report",
     "attempts": 1}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from consumer_sdk.jobs._db import ConnectionT
from consumer_sdk.jobs.model import QUEUE_HEADER, JobId, RunId
from consumer_sdk.outbox import OutboxEvent, write_events

EventType = Literal["run.accepted", "job.resumed", "job.succeeded", "job.failed", "job.cancelled"]


@dataclass(frozen=True, slots=True, kw_only=True)
class JobFacts:
    """What an event says about a job (from the row the transition returned)."""

    job_id: JobId
    run_id: RunId | None
    queue: str
    kind: str
    attempts: int
    traceparent: str | None
    tracestate: str | None
    age_s: float | None = None


def write_job_event(conn: ConnectionT, topic: str, event_type: EventType, facts: JobFacts) -> None:
    """Insert the event in the caller's open transaction (never commits)."""
    write_events(conn, [job_event(topic, event_type, facts)])


def job_event(topic: str, event_type: EventType, facts: JobFacts) -> OutboxEvent:
    """The outbox event announcing ``event_type`` for the job of ``facts`` (no I/O)."""
    payload: dict[str, Any] = {
        "type": event_type,
        "run_id": None if facts.run_id is None else str(facts.run_id),
        "job_id": int(facts.job_id),
        "queue": facts.queue,
        "kind": facts.kind,
        "attempts": facts.attempts,
    }
    key = str(facts.run_id) if facts.run_id is not None else f"job-{facts.job_id}"
    return OutboxEvent(topic=topic, key=key, payload=payload,
                       headers={QUEUE_HEADER: facts.queue, "jobs_event": event_type},
                       traceparent=facts.traceparent, tracestate=facts.tracestate)
