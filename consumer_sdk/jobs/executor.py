"""Run one attempt of one job and write its outcome, fenced.

The handler returns a JSON-encodable result (the job succeeds), or a
:class:`~consumer_sdk.jobs.model.WaitFor` (the job parks), or raises: see
:mod:`consumer_sdk.jobs.retry` for which exception does what.  When the attempt
was cancelled because its lease was lost (or the run cancelled), nothing is
written at all; every write is fenced anyway, and a write that matches no row
is reported as ``lost``.  A database that cannot be reached while writing is logged
and left to the lease: the job is reaped and retried after it expires.  A write the
database refuses for its row (:class:`InvalidJob`: a constraint, a trigger, a value it
cannot store) fails the job for good with the database's words; a missing grant
(:class:`PrivilegeMissing`) is reported to the pool (``on_fatal``), which stops claiming.

An outcome the executor writes (a success it writes itself because the pool writes
terminal events or its result is too large for a round, a retry, a failure and its dead
letter, a park, a release) whose connection broke while it waited for the reply may have
committed all the same (``job_write_unconfirmed``): it is sent again on a new connection
until the lease's local deadline (fenced: written at most once), and one that matches no
row asks the database whether the row is as this lease's write leaves it (the same token,
so never another claim's write): then it is that outcome, confirmed (``completion_confirmed``
for a success, as the dispatcher's rounds do, see :mod:`consumer_sdk.jobs.completions`;
``outcome_confirmed`` for the others).  Reported lost, such an outcome was counted wrong;
never written, the job waited out its lease before it was retried
(:mod:`consumer_sdk.jobs.outcome_writes`).

A handler that failed because the database connection broke under it (the network dropped;
a pooler, a failover or an administrator ended its backend), because its transaction met a
conflict (a deadlock, a serialization failure) or because the database was read-only (a
failover in progress): see :func:`~consumer_sdk.jobs.retry.interruption`, did nothing wrong:
its job is given back, fenced, the attempt not counted (``job_given_back``), up to the pool's
``max_interruptions`` a job in all; past them the attempt counts as any failure's, its error
saying how many of each (:mod:`consumer_sdk.jobs.interruptions`).

A success can be handed to ``complete_later`` instead of being written here (the
worker pool writes the successes of several jobs in one statement, see
:meth:`~consumer_sdk.jobs.worker.WorkerPool.run_once`): the attempt's outcome is then
``completing`` and its log line is written with the completion.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from consumer_sdk import _pg
from consumer_sdk.errors import FatalError
from consumer_sdk.jobs import queue, waits
from consumer_sdk.jobs._db import to_json
from consumer_sdk.jobs.attempt import JobLog, Later, error_written, tidy
from consumer_sdk.jobs.attempt import trace_id as trace_id  # re-exported: completions reads it here
from consumer_sdk.jobs.config import DEFAULT_MAX_INTERRUPTIONS
from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.errors import InvalidJob, LeaseLost, PermanentJobError
from consumer_sdk.jobs.events import JobFacts
from consumer_sdk.jobs.interruptions import GivesBack
from consumer_sdk.jobs.metrics import JobsMetrics
from consumer_sdk.jobs.model import DeadReason, Outcome, WaitFor
from consumer_sdk.jobs.retry import (
    Backoff,
    connection_broke,
    describe,
    error_type,
    interruption,
    verdict,
)

#: A handler: do the job's work for ``ctx``; return its result or a WaitFor, or raise.
Handler = Callable[[JobContext], Any]

#: Takes a success to write later (the attempt, its result as JSON text, the handler's
#: duration); False when it cannot, and the executor writes it at once.
CompleteLater = Callable[[JobContext, str, float], bool]

#: Reasons for which the worker no longer has the right to write anything.
NO_AUTHORITY = frozenset({"lease_lost", "lease_unconfirmed", "cancelled", "fence_ended"})


class Executor(GivesBack):
    """Shared by the pool's threads; holds no per-job state.  Its fenced writes, sent again
    when a reply was lost: :mod:`consumer_sdk.jobs.outcome_writes`; its give-backs of attempts
    that failed through no fault of their job: :mod:`consumer_sdk.jobs.interruptions`."""

    def __init__(self, *, handlers: Mapping[str, Handler], backoff: Backoff, metrics: JobsMetrics,
                 log: Any, events_topic: str | None, db_now: Callable[[], datetime | None],
                 on_retry: Callable[[float], None] = lambda delay_s: None,
                 rand: Callable[[], float] = random.random,
                 complete_later: CompleteLater | None = None,
                 on_fatal: Callable[[FatalError], None] = lambda exc: None,
                 max_interruptions: int = DEFAULT_MAX_INTERRUPTIONS) -> None:
        self.handlers = handlers
        self.backoff = backoff
        self.metrics = metrics
        self.log = log
        self.events_topic = events_topic
        self.db_now = db_now
        self.on_retry = on_retry
        self.rand = rand
        self.on_fatal = on_fatal
        self.max_interruptions = max_interruptions  # WorkerConfig.max_interruptions
        #: Successes go there unless terminal events are written (they need the job's own
        #: transaction).
        self.complete_later = complete_later if not events_topic else None

    def run(self, ctx: JobContext) -> Outcome:
        """Call the handler and write what it came to; returns what was written."""
        job = ctx.job
        log = JobLog(self.log, job)  # bound on first use: a success handed on logs nothing here
        handler = self.handlers.get(job.kind)
        started = time.monotonic()
        later: Later | None = None
        try:
            if handler is None:
                raise PermanentJobError(f"no handler is registered for kind {job.kind!r}")
            ctx.running_since = started
            value = handler(ctx)
        except BaseException as exc:  # noqa: BLE001 - every handler failure is classified
            # KeyboardInterrupt, SystemExit, asyncio.CancelledError or any BaseException a
            # handler raises are its failure too: caught as Exception only, each ended an
            # executor thread, the pool kept claiming jobs for it, and they stayed running.
            ctx.handler_returned()
            tidy(ctx)
            outcome = self._after_error(ctx, exc, log)
        else:
            ctx.handler_returned()
            tidy(ctx)
            found = self._after_return(ctx, value, log)
            later, outcome = (found, "completing") if isinstance(found, Later) else (None, found)
        finally:
            ctx.handler_returned()
            elapsed = time.monotonic() - started
            self.metrics.per_queue(job.queue)[2].observe(elapsed)
        if later is not None:
            assert self.complete_later is not None
            if self.complete_later(ctx, later.result_json, elapsed):
                return "completing"
            outcome = self._write_completion(ctx, log, later.result_json)
        if outcome == "lost":
            self.metrics.leases_lost.labels(job.queue, ctx.cancel_reason or "write_refused").inc()
        log.info("job_attempt_finished", outcome=outcome, duration_s=round(elapsed, 4),
                 reason=ctx.cancel_reason)
        return outcome

    def give_back(self, ctx: JobContext) -> Outcome:
        """A job cancelled before its handler started: released when the pool stops (the
        attempt not counted), else lost (its lease is gone: nothing is written)."""
        if ctx.cancel_reason != "shutdown":
            return "lost"
        return self._release(ctx, self.log.bind(job_id=ctx.job.id))

    # -- outcomes -----------------------------------------------------------------------

    def _after_return(self, ctx: JobContext, value: Any, log: Any) -> Outcome | Later:
        if ctx.cancel_reason == "timed_out":  # the pool wrote its failure (see time_out)
            return "timed_out"
        if ctx.cancel_reason in NO_AUTHORITY:
            return "lost"
        try:
            if isinstance(value, WaitFor):
                return self._park(ctx, value, log)
            result_json = to_json(value, what="result")
            if self.complete_later is not None:
                return Later(result_json)
            return self._write_completion(ctx, log, result_json)
        except InvalidJob as exc:  # the result or wait cannot be encoded: it never will be
            return self._fail(ctx, "permanent_error", exc, log)

    def _after_error(self, ctx: JobContext, exc: BaseException, log: Any) -> Outcome:
        job = ctx.job
        if ctx.cancel_reason == "timed_out":  # the pool wrote its failure (see time_out)
            return "timed_out"
        unproven = self._unproven(ctx, exc)
        if unproven is not None:  # the lease was not found lost: the connection to prove it broke
            exc = unproven
        elif ctx.cancel_reason in NO_AUTHORITY:
            return "lost"
        if ctx.cancel_reason == "shutdown":
            return self._release(ctx, log)
        if _pg.lost_prepared_statement(exc):  # a transaction pooler's doing, not the handler's
            ctx.conn.prepare_threshold = None  # for this connection's next jobs too
            log.warning("job_given_back", error=describe(exc, limit=300),
                        hint="a transaction pooler lost a statement psycopg had prepared; psycopg's "
                             "automatic preparing is off for this connection, the attempt not counted")
            outcome = self._release(ctx, log)
            if outcome == "released":
                self.metrics.given_back.labels(job.queue, "prepared_statement_lost").inc()
            return outcome
        decision = verdict(exc, attempts=job.attempts, max_attempts=job.max_attempts)
        if decision == "lost":
            return "lost"
        note = ""
        cause = interruption(exc, ctx.conn) if decision != "fail_permanent" and self.max_interruptions > 0 else None
        if cause is not None:  # not the job's doing (see consumer_sdk.jobs.interruptions)
            given, note = self._give_back_interrupted(ctx, exc, log, cause)
            if given is not None:
                return given
        if decision == "retry":
            log.info("job_attempt_failed", error=describe(exc, limit=300) + note)
            return self._retry(ctx, exc, log, note)
        reason: DeadReason = "permanent_error" if decision == "fail_permanent" else "attempts_exhausted"
        return self._fail(ctx, reason, exc, log, note)

    def _fail(self, ctx: JobContext, reason: DeadReason, exc: BaseException, log: Any, note: str = "") -> Outcome:
        log.warning("job_failed", reason=reason, error=describe(exc, limit=300) + note)
        return self._dead(ctx, reason, exc, log, note)

    def _unproven(self, ctx: JobContext, exc: BaseException) -> BaseException | None:
        """The driver's error behind the :class:`LeaseLost` a fenced write of the handler raised
        because its connection broke (see ``JobContext._lost_or``): authority could not be
        proven, which cancelled the attempt as ``lease_lost``, not found lost.  Left to its
        lease, the job waited it out and the reaper counted the attempt (on the last one, a
        ``lease_expired`` dead letter); the fenced give-back finds out instead (no row: lost).
        None for any other failure."""
        cause = exc.__cause__
        if ctx.cancel_reason != "lease_lost" or not isinstance(exc, LeaseLost) or cause is None \
                or self.max_interruptions == 0:
            return None
        return cause if connection_broke(cause, ctx.conn) else None

    def _write_completion(self, ctx: JobContext, log: Any, result_json: str) -> Outcome:
        return self._fenced_write(
            ctx, log, lambda conn: queue.complete(conn, ctx.lease, result_json=result_json, now=self.db_now(),
                                                  events_topic=self.events_topic),
            self._succeeded,
            lambda conn: queue.completed_by_lease(conn, worker=ctx.lease.worker,
                                                  leases=[(ctx.job.id, ctx.job.token)]).get(ctx.job.id),
            confirmed="completion_confirmed")

    def _succeeded(self, facts: JobFacts) -> Outcome:
        self.metrics.observe_terminal(facts.queue, "succeeded", age_s=facts.age_s, attempts=facts.attempts)
        return "succeeded"

    def _park(self, ctx: JobContext, wait: WaitFor, log: Any) -> Outcome:
        return self._fenced_write(ctx, log, lambda conn: waits.park(conn, ctx.lease, wait, now=self.db_now()),
                                  lambda status: self._parked(ctx, status),
                                  lambda conn: waits.parked_by_lease(conn, ctx.lease, wait))

    def _parked(self, ctx: JobContext, status: str) -> Outcome:
        self.metrics.parked.labels(ctx.job.queue).inc()
        return "waiting" if status == "waiting" else "requeued"

    def _retry(self, ctx: JobContext, exc: BaseException, log: Any, note: str = "") -> Outcome:
        delay_s = self.backoff.delay_s(ctx.job.attempts, self.rand)
        error, kind = error_written(exc, note), error_type(exc)  # the same in a write sent again and its question
        return self._fenced_write(
            ctx, log, lambda conn: queue.retry(conn, ctx.lease, error=error, error_type=kind, backoff_s=delay_s,
                                               now=self.db_now()),
            lambda due: self._retried(ctx, delay_s),
            lambda conn: queue.retried_by_lease(conn, ctx.lease, attempts=ctx.job.attempts, error=error,
                                                error_type=kind))

    def _retried(self, ctx: JobContext, delay_s: float) -> Outcome:
        self.metrics.retries.labels(ctx.job.queue).inc()
        self.on_retry(delay_s)
        return "retried"

    def _dead(self, ctx: JobContext, reason: DeadReason, exc: BaseException, log: Any, note: str = "") -> Outcome:
        error, kind = error_written(exc, note), error_type(exc)
        return self._fenced_write(
            ctx, log, lambda conn: queue.fail(conn, ctx.lease, reason=reason, error=error, error_type=kind,
                                              now=self.db_now(), events_topic=self.events_topic),
            lambda facts: self._failed(facts, reason),
            lambda conn: queue.failed_by_lease(conn, ctx.lease, attempts=ctx.job.attempts, reason=reason,
                                               error=error, error_type=kind),
            failing=True)

    def _failed(self, facts: JobFacts, reason: DeadReason) -> Outcome:
        self.metrics.dead_lettered.labels(facts.queue, reason).inc()
        self.metrics.observe_terminal(facts.queue, "failed", age_s=facts.age_s, attempts=facts.attempts)
        return "failed"

    def _release(self, ctx: JobContext, log: Any) -> Outcome:
        return self._fenced_write(ctx, log, lambda conn: queue.release(conn, ctx.lease, now=self.db_now()) or None,
                                  lambda _: "released",
                                  lambda conn: queue.released_by_lease(conn, ctx.lease,
                                                                       attempts=ctx.job.attempts) or None)
