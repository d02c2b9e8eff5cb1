"""Give back a job whose attempt failed through no fault of its own, the attempt not counted
(a part of :class:`consumer_sdk.jobs.executor.Executor`).

Three causes (:func:`~consumer_sdk.jobs.retry.interruption`), one budget: the pool's
``max_interruptions`` a job (``jobs.interruptions``, migration 0017; the conflicts and the
read-only ones also counted apart, 0018), so that a job that deadlocks or breaks its backend
every time still comes to an end.  Past it, the attempt counts as any failure's, its error
saying how many of each (:func:`~consumer_sdk.jobs.retry.interruptions_note`), and
``outbox_jobs_given_back_total{cause="interruptions_exhausted"}`` counts it (warning
``job_interruptions_exhausted``).

- ``connection_broke``: the handler's connection is dead; the give-back is written on a new
  one (see :meth:`FencedWrites._send`), due after the first retry's back-off (a job that
  crashes its backend does not restart the database in a tight loop).
- ``conflict`` (a deadlock, a serialization failure): the connection is alive and the give-back
  goes on it; due after a short, fully jittered pause (at most the first retry's back-off and
  1 s), so that two jobs that deadlocked on the same rows do not meet again at once.
- ``read_only`` (a failover in progress, a pooler routing to a standby): written on the
  handler's connection, and on a new one if that session answers read-only too (a session
  keeps its read-only setting; a multi-host DSN finds the new primary only on a new
  connection); due after the retry back-off, growing with each read-only interruption of the
  job, so that the budget outlasts a failover's read-only window (1 + 2 + 4 + 8 + 16 s with
  the default back-off).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from consumer_sdk.jobs import queue
from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.metrics import Interruption, JobsMetrics
from consumer_sdk.jobs.model import Outcome
from consumer_sdk.jobs.outcome_writes import FencedWrites
from consumer_sdk.jobs.queue import GivenBack
from consumer_sdk.jobs.retry import Backoff, describe, error_type, interruptions_note
from outbox_core.secrets import mask_text

#: The longest pause before a job given back after a conflict is due again.
CONFLICT_PAUSE_MAX_S = 1.0

_HINTS: dict[Interruption, str] = {
    "connection_broke": "the database connection broke under the handler (a network drop, a failover, a pooler "
                        "or an administrator ended the backend): the attempt was not counted",
    "conflict": "the database aborted the handler's transaction in a conflict (a deadlock or a serialization "
                "failure with another transaction): the attempt was not counted, the job runs again shortly",
    "read_only": "the database was read-only under the handler (a failover in progress, or a pooler routing to a "
                 "standby): the attempt was not counted, the job runs again after the retry back-off",
}


class GivesBack(FencedWrites):
    """The executor's give-backs (see the module); holds no per-job state."""

    if TYPE_CHECKING:  # the executor's (consumer_sdk/jobs/executor.py)
        backoff: Backoff
        metrics: JobsMetrics
        rand: Callable[[], float]
        on_retry: Callable[[float], None]
        db_now: Callable[[], Any]
        max_interruptions: int

    def _give_back_interrupted(self, ctx: JobContext, exc: BaseException, log: Any,
                               cause: Interruption) -> tuple[Outcome | None, str]:
        """Give the job back, fenced, the attempt not counted.  Returns the outcome and "", or,
        when the job's interruptions reached the pool's limit (nothing written: the attempt is to
        count as before), None and the note its error is to carry."""
        job = ctx.job
        error, kind = mask_text(describe(exc)), error_type(exc)
        delay_s, growth = self._pause_s(cause)
        over: list[str] = []

        def settle(found: GivenBack) -> Outcome:
            if not found.given:
                broke = found.interruptions - found.conflicts - found.read_only
                spent: dict[Interruption, int] = {"connection_broke": broke, "conflict": found.conflicts,
                                                  "read_only": found.read_only}
                over.append(interruptions_note(cause, spent, self.max_interruptions))
                self.metrics.given_back.labels(job.queue, "interruptions_exhausted").inc()
                log.warning("job_interruptions_exhausted", cause=cause, interruptions=found.interruptions,
                            max_interruptions=self.max_interruptions,
                            hint="this attempt failed through no fault of the job's, but its budget of "
                                 "interruptions is spent: it counts as any failure's")
                return "retried"  # stands for the counted attempt that follows
            self.metrics.given_back.labels(job.queue, cause).inc()
            self.on_retry(found.due_in_s)  # the pool claims it when due, not at its next poll
            log.warning("job_given_back", cause=cause, error=error[:300], interruptions=found.interruptions,
                        max_interruptions=self.max_interruptions, due_in_s=round(found.due_in_s, 3),
                        hint=_HINTS[cause])
            return "given_back"

        outcome = self._fenced_write(
            ctx, log, lambda conn: queue.give_back(
                conn, ctx.lease, cause=cause, error=error, error_type=kind, delay_s=delay_s, growth=growth,
                max_delay_s=max(delay_s, self.backoff.max_s), max_interruptions=self.max_interruptions,
                now=self.db_now()),
            settle, lambda conn: queue.found_given_back(conn, ctx.lease, attempts=job.attempts, error=error,
                                                        error_type=kind, now=self.db_now()))
        return (None, over[0]) if over and outcome != "lost" else (outcome, "")

    def _pause_s(self, cause: Interruption) -> tuple[float, float]:
        """The first pause before the job is due again, and its growth with each read-only
        interruption the job already had (see the module)."""
        if cause == "conflict":
            return self.rand() * min(self.backoff.ceiling_s(1), CONFLICT_PAUSE_MAX_S), 1.0
        growth = self.backoff.multiplier if cause == "read_only" else 1.0
        return self.backoff.delay_s(1, self.rand), growth
