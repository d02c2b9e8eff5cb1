"""The successes of a worker pool's executors, written by the dispatcher's next round.

An executor whose handler returned hands the success here (:meth:`Completions.add`)
and takes its next job; the job stays 'running', leased to the pool (the heartbeat
renews it), until the dispatcher writes the completions of every job that succeeded
since its last round in its claim's statement (:meth:`Completions.take`, then
:meth:`Completions.settle` with what the database returned).  A completion is fenced
like every write: a job whose lease was lost meanwhile is settled as ``lost``, and one
whose lease the pool already knows lost (cancelled, unconfirmed) is not written at all.

So a job whose handler returned stays 'running' until the next round writes it, at
most ``within_s`` later when no round comes sooner.  Should the process die in between,
the lease expires and the job runs again: its handler's fenced writes had committed,
so a handler must make them idempotent (results by key, ``effect_key``), which a crash
between a fenced commit and the completion already required.

Thread-safe with the pool's lock (``lock``), under which the pool's ``running`` map of
leased attempts is kept: a written (or refused) completion leaves it.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.events import JobFacts
from consumer_sdk.jobs.executor import NO_AUTHORITY, trace_id
from consumer_sdk.jobs.metrics import JobsMetrics
from consumer_sdk.jobs.model import JobId
from consumer_sdk.jobs.queue import Done

T = TypeVar("T")
#: The results' characters one round writes at most (PostgreSQL caps the statement's jsonb
#: array of completions at 256 MB: two results of 140 MB failed it at every round, for ever).
MAX_ROUND_CHARS = 32 * 1024 * 1024
#: Writes these completions (and maybe more): (the facts of the jobs completed, the rest).
Write = Callable[[Sequence[Done]], tuple[Mapping[JobId, JobFacts], T]]


class Pending:
    """A success waiting for its completion."""

    __slots__ = ("ctx", "done", "duration_s")

    def __init__(self, ctx: JobContext, done: Done, duration_s: float) -> None:
        self.ctx, self.done, self.duration_s = ctx, done, duration_s


class Completions:
    """Successes waiting for a round, oldest first, and when the oldest must be written."""

    def __init__(self, *, lock: threading.Condition, running: dict[JobId, JobContext], metrics: JobsMetrics,
                 log: Any, outcomes: Counter[str], clock: Callable[[], float], within_s: float) -> None:
        self._lock = lock
        self._running = running
        self.metrics = metrics
        self.log = log
        self.outcomes = outcomes
        self._clock = clock
        self.within_s = within_s
        self._pending: list[Pending] = []
        self._chars = 0  # the pending results' characters
        #: When the oldest success must be written at the latest (None: none waits).
        self.due: float | None = None
        #: The owners of the jobs the last write completed, with how many each.
        self.last_written: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, ctx: JobContext, result_json: str, duration_s: float, *, wake_before: float) -> bool | None:
        """Keep a success (call it under the lock); True when it is the first since the last
        round and due before ``wake_before``: the dispatcher must be woken.  None, and not
        kept, when the round has no room for its result: its executor writes it alone."""
        if self._chars + len(result_json) > MAX_ROUND_CHARS:
            return None
        ctx.completing = True
        self._chars += len(result_json)
        self._pending.append(Pending(ctx, Done(ctx.job.id, ctx.job.token, result_json), duration_s))
        if self.due is not None:
            return False
        self.due = self._clock() + self.within_s
        return self.due < wake_before

    def write_with(self, write: Write[T]) -> T:
        """Take every waiting success, ``write`` them and settle them; put them back first
        in line if ``write`` raises."""
        with self._lock:
            pending, self._pending, self.due, self._chars = self._pending, [], None, 0
        self.last_written = Counter()
        lost = [p for p in pending if p.ctx.cancel_reason in NO_AUTHORITY]
        if lost:  # not written at all: the pool knows their lease lost
            self.settle(lost, {})
            pending = [p for p in pending if p.ctx.cancel_reason not in NO_AUTHORITY]
        try:
            facts, rest = write([p.done for p in pending])
        except BaseException:
            if pending:
                with self._lock:
                    self._pending[:0] = pending
                    self._chars += sum(len(p.done.result_json) for p in pending)
                    self.due = self._clock() + self.within_s
            raise
        self.settle(pending, facts)
        self.last_written = Counter(p.ctx.job.owner_id for p in pending if p.ctx.job.id in facts)
        return rest

    def settle(self, pending: list[Pending], facts: Mapping[JobId, JobFacts]) -> None:
        """Account for written completions (in ``facts``) and refused ones (lost)."""
        if not pending:
            return
        for p in pending:
            job = p.ctx.job
            found = facts.get(job.id)
            if found is not None:
                outcome = "succeeded"
                self.metrics.observe_terminal(found.queue, "succeeded", age_s=found.age_s,
                                              attempts=found.attempts)
            else:
                outcome = "lost"
                self.metrics.leases_lost.labels(job.queue, p.ctx.cancel_reason or "write_refused").inc()
                if p.ctx.cancel_reason is None:  # else the heartbeat said so already
                    self.log.warning("lease_lost", job_id=job.id, token=job.token,
                                     detail="the completion matched no row")
            self.outcomes[outcome] += 1
            self.log.info("job_attempt_finished", job_id=job.id, queue=job.queue, kind=job.kind,
                          attempt=job.attempts, token=job.token, trace_id=trace_id(job.traceparent),
                          outcome=outcome, duration_s=round(p.duration_s, 4), reason=p.ctx.cancel_reason)
        with self._lock:
            for p in pending:
                self._running.pop(p.ctx.job.id, None)
