"""Handlers that run past ``WorkerConfig.handler_timeout_s``: the attempt fails, written by the pool.

Off by default (long work is legitimate).  With a limit, the heartbeat checks the running
handlers at each renewal, before its statement: an attempt past the limit is cancelled,
reason ``timed_out`` (``ctx.cancelled``, ``ctx.check()`` and ``ctx.sleep()`` raise
:class:`~consumer_sdk.jobs.errors.LeaseLost`, fenced writes are refused), its lease is not
renewed any more, and its failure, ``HandlerTimedOut: handler timed out after N s``, is
written on the heartbeat's connection under the attempt's lease token: a retry with
back-off, or the dead letter (``attempts_exhausted``) after the last attempt.  When the
handler returns later, nothing more is written for it (``timed_out``), and a write of its
own is fenced out (the job is no longer running under its token).  A failure whose reply
was lost (the connection broke after it was sent) may have committed: it is sent again on
a new connection, at once and then at each heartbeat until the lease's local deadline, and,
matching no row, read back under the lease's token (``outcome_confirmed``), as the
executor's outcomes are.  It was logged ``job_timeout_write_failed``, "the job is reaped",
and counted lost, for a retry or a dead letter the database had.

A thread stuck in Python code cannot be killed: the stuck handler keeps its executor
thread, its connection and its slot until it returns.  The pool starts no thread in its
place (its threads and connections stay bounded by ``max_concurrency``), so each stuck
handler is one slot less, never counted as free: ``handler_stuck`` says so when it times
out, ``pool.health()`` counts them (``stuck_handlers``) and is not ready once every slot
is stuck, the gauge ``outbox_jobs_handlers_stuck`` (read when scraped) counts them too, and
``outbox_jobs_oldest_running_age_seconds`` keeps showing them.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

from consumer_sdk.errors import DatabaseUnavailable, OutboxSdkError
from consumer_sdk.jobs import queue
from consumer_sdk.jobs._conn import outcome_unknown
from consumer_sdk.jobs.config import WorkerConfig
from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.errors import HandlerTimedOut
from consumer_sdk.jobs.events import JobFacts
from consumer_sdk.jobs.executor import Executor
from consumer_sdk.jobs.model import Outcome
from consumer_sdk.jobs.retry import describe, error_type, verdict


class HandlerTimeouts:
    """Times out the handlers past ``timeout_s`` (None: never) and keeps the stuck ones."""

    def __init__(self, config: WorkerConfig, executor: Executor, outcomes: Counter[str], log: Any) -> None:
        self.timeout_s = config.handler_timeout_s
        self._executor = executor
        self._outcomes = outcomes
        self._capacity = config.max_concurrency
        self.log = log
        self._lock = threading.Lock()
        self._stuck: list[JobContext] = []  # timed out, their handlers not returned yet
        #: Failures whose reply was lost, asked again at each run (the heartbeat's thread only).
        self._unconfirmed: list[_Write] = []

    def stuck(self) -> list[JobContext]:
        """The attempts timed out whose handlers still run (each holds a thread and a slot)."""
        with self._lock:
            self._stuck = [c for c in self._stuck if c.running_since is not None]
            return list(self._stuck)

    def run(self, conn_of: Callable[[], Any], running: list[JobContext], now: float | None = None) -> int:
        """Time out the handlers of ``running`` past the limit and write their failures on
        ``conn_of()``'s connection; returns how many timed out.  First the failures whose
        reply was lost are sent again (see :meth:`_ask_again`)."""
        if self.timeout_s is None:
            return 0
        now = time.monotonic() if now is None else now
        self._ask_again(conn_of, now)
        due = [c for c in running if (s := c.running_since) is not None and now - s >= self.timeout_s]
        timed_out = [c for c in due if c.time_out()]  # atomic with the handler's return
        for ctx in timed_out:
            with self._lock:
                self._stuck.append(ctx)
            self._write(conn_of, self._failure(ctx), now)
        return len(timed_out)

    def _failure(self, ctx: JobContext) -> _Write:
        """The timed-out attempt's failure: a retry with back-off, or its dead letter."""
        job, ex = ctx.job, self._executor
        exc = HandlerTimedOut(f"handler timed out after {self.timeout_s:g} s")
        error, kind = describe(exc), error_type(exc)
        log = self.log.bind(job_id=job.id, queue=job.queue, kind=job.kind, attempt=job.attempts, token=job.token)
        if verdict(exc, attempts=job.attempts, max_attempts=job.max_attempts) == "retry":
            delay_s = ex.backoff.delay_s(job.attempts, ex.rand)  # the same in a write sent again
            return _Write(
                ctx, log, error,
                lambda conn: queue.retry(conn, ctx.lease, error=error, error_type=kind, backoff_s=delay_s,
                                         now=ex.db_now()),
                lambda conn: queue.retried_by_lease(conn, ctx.lease, attempts=job.attempts, error=error,
                                                    error_type=kind),
                lambda due: self._retried(job.queue, delay_s))
        return _Write(
            ctx, log, error,
            lambda conn: queue.fail(conn, ctx.lease, reason="attempts_exhausted", error=error, error_type=kind,
                                    now=ex.db_now(), events_topic=ex.events_topic),
            lambda conn: queue.failed_by_lease(conn, ctx.lease, attempts=job.attempts, reason="attempts_exhausted",
                                               error=error, error_type=kind),
            self._failed)

    def _write(self, conn_of: Callable[[], Any], write: _Write, now: float) -> None:
        """Write the failure.  When the connection broke while the write waited for its reply,
        it may have committed all the same: it is kept to be sent again (:meth:`_ask_again`),
        at once and then at each run, never waited for here: this is the heartbeat's thread,
        which renews the other attempts' leases."""
        write.ctx.ending = True  # this write says whether the lease held (see heartbeat)
        conn = None
        try:
            conn = conn_of()
            done = write.send(conn)
        except DatabaseUnavailable as exc:
            if conn is None or not outcome_unknown(exc, conn):
                self._not_written(write, exc, "could not be written:")
                return
            write.log.warning("job_write_unconfirmed", error=str(exc),
                              detail="the connection broke while the timed-out attempt's failure was being "
                                     "written: sent again on a new connection, which finds out whether it was")
            self._unconfirmed.append(write)
            self._ask_again(conn_of, now)
            return
        except OutboxSdkError as exc:
            self._not_written(write, exc, "could not be written:")
            return
        self._settled(write, "lost" if done is None else write.settle(done))

    def finish(self, conn_of: Callable[[], Any]) -> None:
        """The pool stops (the heartbeat's last act): each failure whose reply was lost is
        asked about once more; one still without an answer is said and counted lost (the
        stop dropped them without a word before)."""
        self._ask_again(conn_of, math.inf, unanswered="was sent, its reply lost, and the pool stopped before "
                                                      "the database could be asked: if it was not written,")

    def _ask_again(self, conn_of: Callable[[], Any], now: float,
                   unanswered: str = "was sent, its reply lost, and the database could not be asked before "
                                     "the lease's deadline: if it was not written,") -> None:
        """Send each failure whose reply was lost again on a new connection (fenced: written at
        most once); one that matches no row asks the database whether the job is as this
        lease's write leaves it (the same token, so never another claim's write), as the
        executor does (:mod:`.executor`).  Without an answer, asked again at the next run,
        until the lease's local deadline (then ``unanswered`` says why it may not be written)."""
        for write in list(self._unconfirmed):
            try:
                outcome = self._send_again(conn_of(), write)
            except DatabaseUnavailable as exc:
                if now < write.ctx.deadline:
                    continue
                self._unconfirmed.remove(write)
                self._not_written(write, exc, unanswered)
                continue
            except OutboxSdkError as exc:
                self._unconfirmed.remove(write)
                self._not_written(write, exc, "was sent, its reply lost, and sent again it could not be "
                                              "written: if the first was not,")
                continue
            self._unconfirmed.remove(write)
            self._settled(write, outcome)

    @staticmethod
    def _send_again(conn: Any, write: _Write) -> Outcome:
        done = write.send(conn)
        if done is not None:
            return write.settle(done)
        done = write.confirm(conn)
        if done is None:
            return "lost"
        outcome = write.settle(done)
        write.log.info("outcome_confirmed", outcome=outcome,
                       detail="an earlier statement had written it: its reply was lost")
        return outcome

    def _not_written(self, write: _Write, exc: OutboxSdkError, what: str) -> None:
        """``what``: why the failure may not be written, before what then happens to the job."""
        write.log.warning("job_timeout_write_failed", error=str(exc),
                          detail=f"the timed-out attempt's failure {what} its lease, no longer renewed, "
                                 "expires and the job is reaped")
        self._outcomes["lost"] += 1

    def _settled(self, write: _Write, outcome: Outcome) -> None:
        self._outcomes[outcome] += 1
        job, limit, stuck = write.ctx.job, self.timeout_s, len(self.stuck())
        write.log.warning("job_timed_out", timeout_s=limit, outcome=outcome, error=write.error)
        write.log.warning("handler_stuck", stuck_handlers=stuck, max_concurrency=self._capacity,
                          detail=f"the handler of job {job.id} ran past handler_timeout_s={limit:g} s and was "
                                 "cancelled; Python cannot kill its thread, so it keeps its worker slot until it "
                                 f"returns: {stuck} of {self._capacity} slots are held so")

    def _retried(self, queue_name: str, delay_s: float) -> Outcome:
        ex = self._executor
        ex.metrics.retries.labels(queue_name).inc()
        ex.on_retry(delay_s)
        return "retried"

    def _failed(self, facts: JobFacts) -> Outcome:
        metrics = self._executor.metrics
        metrics.dead_lettered.labels(facts.queue, "attempts_exhausted").inc()
        metrics.observe_terminal(facts.queue, "failed", age_s=facts.age_s, attempts=facts.attempts)
        return "failed"


class _Write(NamedTuple):
    """One timed-out attempt's failure, fenced: ``send`` returns what it wrote (None: no row
    matched, the lease is lost), ``confirm`` what an earlier send of this lease wrote (None:
    nothing), ``settle`` counts it and names the outcome."""

    ctx: JobContext
    log: Any
    error: str
    send: Callable[[Any], Any]
    confirm: Callable[[Any], Any]
    settle: Callable[[Any], Outcome]
