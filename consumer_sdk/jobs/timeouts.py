"""Handlers that run past ``WorkerConfig.handler_timeout_s``: the attempt fails, written by the pool.

Off by default (long work is legitimate).  With a limit, the heartbeat checks the running
handlers at each renewal, before its statement: an attempt past the limit is cancelled,
reason ``timed_out`` (``ctx.cancelled``, ``ctx.check()`` and ``ctx.sleep()`` raise
:class:`~consumer_sdk.jobs.errors.LeaseLost`, fenced writes are refused), its lease is not
renewed any more, and its failure, ``HandlerTimedOut: handler timed out after N s``, is
written on the heartbeat's connection under the attempt's lease token: a retry with
back-off, or the dead letter (``attempts_exhausted``) after the last attempt.  When the
handler returns later, nothing more is written for it (``timed_out``), and a write of its
own is fenced out (the job is no longer running under its token).

A thread stuck in Python code cannot be killed: the stuck handler keeps its executor
thread, its connection and its slot until it returns.  The pool starts no thread in its
place (its threads and connections stay bounded by ``max_concurrency``), so each stuck
handler is one slot less, never counted as free: ``handler_stuck`` says so when it times
out, ``pool.health()`` counts them (``stuck_handlers``) and is not ready once every slot
is stuck, the gauge ``outbox_jobs_handlers_stuck`` (read when scraped) counts them too, and
``outbox_jobs_oldest_running_age_seconds`` keeps showing them.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from consumer_sdk.errors import OutboxSdkError
from consumer_sdk.jobs import queue
from consumer_sdk.jobs.config import WorkerConfig
from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.errors import HandlerTimedOut
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

    def stuck(self) -> list[JobContext]:
        """The attempts timed out whose handlers still run (each holds a thread and a slot)."""
        with self._lock:
            self._stuck = [c for c in self._stuck if c.running_since is not None]
            return list(self._stuck)

    def run(self, conn_of: Callable[[], Any], running: list[JobContext], now: float | None = None) -> int:
        """Time out the handlers of ``running`` past the limit and write their failures on
        ``conn_of()``'s connection; returns how many timed out."""
        if self.timeout_s is None:
            return 0
        now = time.monotonic() if now is None else now
        due = [c for c in running if (s := c.running_since) is not None and now - s >= self.timeout_s]
        timed_out = [c for c in due if c.time_out()]  # atomic with the handler's return
        for ctx in timed_out:
            with self._lock:
                self._stuck.append(ctx)
            self._outcomes[self._write(conn_of, ctx)] += 1
        return len(timed_out)

    def _write(self, conn_of: Callable[[], Any], ctx: JobContext) -> Outcome:
        job, limit = ctx.job, self.timeout_s
        exc = HandlerTimedOut(f"handler timed out after {limit:g} s")
        error, kind = describe(exc), error_type(exc)
        ctx.ending = True  # this write says whether the lease held (see heartbeat)
        log = self.log.bind(job_id=job.id, queue=job.queue, kind=job.kind, attempt=job.attempts, token=job.token)
        try:
            outcome = self._retry(conn_of(), ctx, error, kind) \
                if verdict(exc, attempts=job.attempts, max_attempts=job.max_attempts) == "retry" \
                else self._dead(conn_of(), ctx, error, kind)
        except OutboxSdkError as failed:
            log.warning("job_timeout_write_failed", error=str(failed),
                        detail="the timed-out attempt's failure could not be written: its lease, no longer "
                               "renewed, expires and the job is reaped")
            return "lost"
        stuck = len(self.stuck())
        log.warning("job_timed_out", timeout_s=limit, outcome=outcome, error=error)
        log.warning("handler_stuck", stuck_handlers=stuck, max_concurrency=self._capacity,
                    detail=f"the handler of job {job.id} ran past handler_timeout_s={limit:g} s and was "
                           "cancelled; Python cannot kill its thread, so it keeps its worker slot until it "
                           f"returns: {stuck} of {self._capacity} slots are held so")
        return outcome

    def _retry(self, conn: Any, ctx: JobContext, error: str, kind: str) -> Outcome:
        ex = self._executor
        delay_s = ex.backoff.delay_s(ctx.job.attempts, ex.rand)
        due = queue.retry(conn, ctx.lease, error=error, error_type=kind, backoff_s=delay_s, now=ex.db_now())
        if due is None:
            return "lost"
        ex.metrics.retries.labels(ctx.job.queue).inc()
        ex.on_retry(delay_s)
        return "retried"

    def _dead(self, conn: Any, ctx: JobContext, error: str, kind: str) -> Outcome:
        ex = self._executor
        facts = queue.fail(conn, ctx.lease, reason="attempts_exhausted", error=error, error_type=kind,
                           now=ex.db_now(), events_topic=ex.events_topic)
        if facts is None:
            return "lost"
        ex.metrics.dead_lettered.labels(facts.queue, "attempts_exhausted").inc()
        ex.metrics.observe_terminal(facts.queue, "failed", age_s=facts.age_s, attempts=facts.attempts)
        return "failed"
