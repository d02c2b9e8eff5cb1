"""Plain data of runs and jobs (no I/O): ids, statuses, claimed jobs, leases, policies.

Ids are ``NewType``s so a job id is never passed where a token is expected.
Times from the database are timezone-aware ``datetime``s; durations are
seconds in ``float`` with ``_s`` in their names.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, NewType

from consumer_sdk.jobs import _check
from consumer_sdk.jobs._check import MAX_DELAY_S
from consumer_sdk.jobs._check import QUEUE_NAME as QUEUE_NAME
from consumer_sdk.jobs.errors import InvalidJob

JobId = NewType("JobId", int)
RunId = NewType("RunId", uuid.UUID)
Token = NewType("Token", int)

JobStatus = Literal["queued", "running", "waiting", "succeeded", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})

#: Why a job was dead-lettered (the CHECK constraint of job_dead_letters.reason).
DeadReason = Literal["permanent_error", "attempts_exhausted", "lease_expired"]

#: What a worker did with one claimed job.
Outcome = Literal["succeeded", "retried", "failed", "waiting", "requeued", "released", "given_back", "lost",
                  "completing", "timed_out"]

#: Well-known queues; any name matching :data:`QUEUE_NAME` (use ``fullmatch``) works.
INTERACTIVE = "interactive"
BULK = "bulk"

#: Outbox header naming the queue of the job an event is about (the wake-up hint).
QUEUE_HEADER = "jobs_queue"


@dataclass(frozen=True, slots=True)
class Lease:
    """A worker's authority over one job: every write it makes carries all three fields."""

    job_id: JobId
    worker: str
    token: Token


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimedJob:
    """A job as a claim returned it.  ``attempts`` counts this attempt (1 for the first).

    ``wait_key``/``activation`` are set when the job resumes after waiting: the
    key it waited for and the recorded activation's payload (None when it was
    woken by its timeout).  ``payload_bytes``: the size of its payload (or its run's goal)
    and activation payload as the claim counted them against the pool's
    ``max_payload_bytes`` (uncompressed); the pool holds it until the attempt ends.
    """

    id: JobId
    run_id: RunId | None
    owner_id: str
    queue: str
    kind: str
    worker: str
    token: Token
    attempts: int
    max_attempts: int
    payload: Any
    traceparent: str | None
    tracestate: str | None
    wait_key: str | None
    activation: Any
    created_epoch: float
    payload_bytes: int = 0

    @property
    def lease(self) -> Lease:
        return Lease(self.id, self.worker, self.token)

    @property
    def last_attempt(self) -> bool:
        return self.attempts >= self.max_attempts


@dataclass(frozen=True, slots=True, kw_only=True)
class NewJob:
    """A standalone job to enqueue (a run's job is created by ``accept``).

    Checked at construction with ``accept``'s rules (:class:`~consumer_sdk.jobs.errors.InvalidJob`
    otherwise): ``owner_id`` and ``kind`` 1-200 characters, ``queue`` a queue name,
    ``max_attempts`` an int from 1 to 2**31-1, ``delay_s`` finite from 0 to 100 years;
    a malformed ``traceparent`` string is dropped (with ``tracestate``) and logged.
    The payload is checked by ``enqueue`` (JSON-encodable, storable).
    """

    owner_id: str
    queue: str
    kind: str
    payload: Any
    max_attempts: int = 5
    delay_s: float = 0.0
    traceparent: str | None = None
    tracestate: str | None = None

    def __post_init__(self) -> None:
        _check.job_fields(owner_id=self.owner_id, kind=self.kind, queue_name=self.queue,
                          max_attempts=self.max_attempts)
        _check.seconds("delay_s", self.delay_s, 0.0, MAX_DELAY_S)
        traceparent, tracestate = _check.trace(self.traceparent, self.tracestate)
        if (traceparent, tracestate) != (self.traceparent, self.tracestate):
            object.__setattr__(self, "traceparent", traceparent)
            object.__setattr__(self, "tracestate", tracestate)


#: The longest activation key; the longest wait cause.
MAX_KEY_CHARS = 500
MAX_CAUSE_CHARS = 1000


@dataclass(frozen=True, slots=True)
class WaitFor:
    """Returned by a handler to park its job: the worker is freed until an activation arrives.

    ``key`` names the awaited fact (an approval, a callback); :func:`activate`
    with the same key resumes the job, also when it arrives before the job
    parked.  ``timeout_s`` resumes it anyway after that many seconds (the
    handler then sees ``ctx.activation is None``).  At least one of the two is
    required.  A key stays recorded: waiting again on a key already activated
    resumes at once, so use one key per awaited fact.

    Checked at construction (:class:`~consumer_sdk.jobs.errors.InvalidJob`, a
    ``ValueError``): ``key`` None or 1-500 characters, ``cause`` a string of at most
    1,000 characters, ``timeout_s`` None or finite from 0 to 100 years.
    """

    key: str | None
    cause: str
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.key is None and self.timeout_s is None:
            raise InvalidJob("WaitFor needs an activation key, a timeout_s, or both")
        if self.key is not None:
            _check.text("WaitFor key", self.key, max_chars=MAX_KEY_CHARS)
        _check.text("WaitFor cause", self.cause, max_chars=MAX_CAUSE_CHARS, min_chars=0)
        if self.timeout_s is not None:
            _check.seconds("WaitFor timeout_s", self.timeout_s, 0.0, MAX_DELAY_S)


@dataclass(frozen=True, slots=True)
class Accepted:
    """What ``accept`` returns, after its transaction committed.

    ``created`` is False when the same owner, key and body had been accepted
    before: the existing run is returned and nothing new was written.
    """

    run_id: RunId
    job_id: JobId
    created: bool
    status: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RunState:
    """A run as its owner sees it.  ``status`` is its job's status."""

    run_id: RunId
    job_id: JobId
    owner_id: str
    request_key: str
    kind: str
    queue: str
    goal: Any
    status: str
    attempts: int
    max_attempts: int
    result: Any
    last_error: str | None
    last_error_type: str | None
    wait_cause: str | None
    wait_key: str | None
    dead_reason: str | None
    traceparent: str | None
    created_at: datetime
    finished_at: datetime | None
    available_in_s: float

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadLetterRecord:
    """A job that ended in ``failed``: why, its last error, its attempts and trace."""

    job_id: JobId
    run_id: RunId | None
    owner_id: str
    queue: str
    kind: str
    reason: str
    error: str
    error_type: str | None
    attempts: int
    traceparent: str | None
    trace_id: str | None
    dead_at: datetime


@dataclass(frozen=True, slots=True)
class Activation:
    """What ``activate`` did: whether the key was new, and which parked jobs it resumed."""

    recorded: bool
    resumed: tuple[JobId, ...]


@dataclass(frozen=True, slots=True)
class Lane:
    """One owner's ready work in one queue: ``ready`` counted up to a cap, ``running`` in all queues."""

    queue: str
    owner_id: str
    ready: int
    running: int


@dataclass(frozen=True, slots=True)
class Take:
    """Claim up to ``n`` jobs of one lane; ``owner_limit`` is checked again in SQL."""

    queue: str
    owner_id: str
    n: int
    owner_limit: int


@dataclass(frozen=True, slots=True)
class QueueStats:
    queue: str
    ready: int
    oldest_age_s: float
    running: int
    waiting: int


MAX_CAPACITY_PER_S = 1_000_000.0
MAX_HORIZON_S = 86_400.0
MAX_PENDING = 1_000_000_000  # count_cap (2 * bound + 1) stays a PostgreSQL integer


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionPolicy:
    """Admission control of one queue: refuse when the backlog exceeds ``horizon_s`` of work.

    ``capacity_per_s`` is how many jobs per second the queue's workers finish
    (configured from measurement); the bound is ``capacity_per_s * horizon_s``
    pending (queued or running) jobs.  The check is soft: concurrent accepts may
    pass it together by a few jobs.

    Both are checked at construction (:class:`~consumer_sdk.jobs.errors.InvalidJob`, a
    ``ValueError``): finite, positive, ``capacity_per_s`` at most 1,000,000 a second,
    ``horizon_s`` at most a day, and their product (the bound) at most 1,000,000,000 jobs.
    """

    capacity_per_s: float
    horizon_s: float

    def __post_init__(self) -> None:
        _check.seconds("capacity_per_s", self.capacity_per_s, 0.0, MAX_CAPACITY_PER_S, lo_open=True,
                       unit="jobs a second")
        _check.seconds("horizon_s", self.horizon_s, 0.0, MAX_HORIZON_S, lo_open=True)
        if self.capacity_per_s * self.horizon_s > MAX_PENDING:
            raise InvalidJob(f"capacity_per_s * horizon_s must be at most {MAX_PENDING:,} jobs, got "
                             f"{self.capacity_per_s * self.horizon_s:g}")

    @property
    def max_pending(self) -> int:
        return max(1, math.floor(self.capacity_per_s * self.horizon_s))

    @property
    def count_cap(self) -> int:
        """How far the backlog is counted: far enough to estimate a Retry-After."""
        return self.max_pending * 2 + 1

    def refuses(self, pending: int) -> bool:
        return pending >= self.max_pending

    def retry_after_s(self, pending: int) -> int:
        """Whole seconds until ``pending`` drains below the bound, between 1 and the horizon."""
        excess = pending - self.max_pending + 1
        seconds = math.ceil(excess / self.capacity_per_s)
        return int(min(max(1, seconds), max(1, math.ceil(self.horizon_s))))
