"""The reconciler: what no wake-up may be trusted to do.

One pass (:meth:`Reconciler.run_once`):

1. resumes parked jobs whose activation is recorded although they still wait
   (the activation's wake-up was lost) or whose timeout passed;
2. reaps running jobs whose lease expired (requeued, or failed and dead-lettered
   when their attempts are used up);
3. refreshes the queue gauges (oldest pending age, pending, running, waiting).

Every worker pool runs it on a timer (``reconcile_interval_s``); it can also run
alone (``start``/``stop``), e.g. in a service that accepts runs but runs no
workers.  Passes are idempotent and safe to run from several processes at once:
every transition is conditioned on the previous status and skips locked rows.

In a worker pool the pass runs between claims, on the dispatcher's session, whose
statements the pool's ``statement_timeout`` bounds (``pool_statement_timeout_s``).  A step
whose statement that timeout cancels (a large jobs table, a lock held long) is skipped and
named (``reconcile_timed_out``: its ``step``, the database's words): the pass goes on with
its next step and the round with its claim.  The step is held off for four times the wait it
cost, doubled while it times out in a row (at most 10 minutes; ``next_try_in_s``), the reaps
between passes too, so that claims wait on it at most a fifth of the time;
``reconcile_step_recovered`` when it passes again.  Before, such a pass failed the whole round every
``reconcile_interval_s``: no claim in it, ``dispatch_failed`` for upkeep the claims do not
need, and the pass's later steps never ran.  Alone, a pass raises as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import structlog

from consumer_sdk.errors import OutboxSdkError
from consumer_sdk.jobs import queue, waits
from consumer_sdk.jobs._conn import ConnectionFactory, ConnSlot
from consumer_sdk.jobs._db import ConnectionT, q, translated
from consumer_sdk.jobs.errors import StatementTimedOut
from consumer_sdk.jobs.metrics import JobsMetrics
from consumer_sdk.jobs.metrics import ReconcileStep as Step  # a pass's steps, with their metric
from consumer_sdk.jobs.model import QueueStats
from consumer_sdk.jobs.refusals import Refusals, Refused

#: A step the pool's timeout cancelled is not tried again for this many times the wait it cost
#: the dispatcher, doubled at each timeout in a row, at most MAX_HOLD_OFF_S: the claims wait on
#: it at most a fifth of the time (retried at every pass, a step that always timed out held
#: the dispatcher most of the time: its wait, then a pass due again at once).
HOLD_OFF_FACTOR = 4.0
MAX_HOLD_OFF_S = 600.0
_TIMED_OUT_HINT = ("the database answers, too slowly for this step (a large jobs table, a lock held long: "
                   "jobs_lock_wait names one): skipped, the claims go on, tried again in next_try_in_s (four times "
                   "its wait, doubled while it times out); meanwhile its work waits (the gauges keep their last "
                   "values). "
                   "Look for what slows it (pg_stat_activity, pg_stat_statements); raise pool_statement_timeout_s "
                   "only if the step is expected to take that long")


@dataclass(slots=True)
class ReconcileResult:
    """What one pass did (counts of jobs), and the steps the pool's timeout skipped."""

    resumed_lost: int = 0
    resumed_timeout: int = 0
    requeued_expired: int = 0
    failed_expired: int = 0
    stats: list[QueueStats] = field(default_factory=list)
    timed_out: list[Step] = field(default_factory=list)
    held_off: list[Step] = field(default_factory=list)  # not run: they timed out before


@dataclass(frozen=True, slots=True)
class _HeldOff:
    """A step not tried again before ``until`` (monotonic), after ``streak`` timeouts in a row."""

    until: float
    streak: int


def record_reaped(reaped: Sequence[queue.Reaped], metrics: JobsMetrics, log: Any) -> tuple[int, int]:
    """Count and log reaped jobs; returns (requeued, failed)."""
    requeued = failed = 0
    for item in reaped:
        metrics.lease_expirations.labels(item.facts.queue).inc()
        if item.outcome == "failed":
            failed += 1
            metrics.dead_lettered.labels(item.facts.queue, "lease_expired").inc()
            metrics.observe_terminal(item.facts.queue, "failed", age_s=item.facts.age_s,
                                     attempts=item.facts.attempts)
        else:
            requeued += 1
    if reaped:
        log.info("leases_expired", requeued=requeued, failed=failed,
                 job_ids=[int(item.facts.job_id) for item in reaped[:20]])
    return requeued, failed


def active_queues(conn: ConnectionT) -> list[str]:
    """Every queue with queued, running or waiting jobs, in name order."""
    with translated():
        return [r[0] for r in conn.execute(q("active_queues")).fetchall()]


def queue_stats(conn: ConnectionT, queues: Sequence[str], *, now: datetime | None = None) -> list[QueueStats]:
    with translated():
        rows = conn.execute(q("queue_stats"), {"queues": list(queues), "now": now}).fetchall()
    return [QueueStats(r[0], r[1], float(r[2]), r[3], r[4]) for r in rows]


class Reconciler:
    """Resumes lost activations, reaps expired leases, refreshes gauges.  Start/stop or run_once."""

    def __init__(self, *, queues: Sequence[str], metrics: JobsMetrics | None = None, log: Any = None,
                 connect: ConnectionFactory | None = None, interval_s: float = 10.0,
                 events_topic: str | None = None, batch: int = 500,
                 db_now: Callable[[], datetime | None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.queues = list(queues)
        self.metrics = metrics if metrics is not None else JobsMetrics()
        self.log = log if log is not None else structlog.get_logger("consumer_sdk.jobs.reconciler")
        self.interval_s = interval_s
        self.events_topic = events_topic
        self.batch = batch
        self.db_now = db_now
        self._slot = ConnSlot(connect) if connect is not None else None
        self._clock = clock
        self._held_off: dict[Step, _HeldOff] = {}  # the pool's steps its timeout cancelled
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self, conn: ConnectionT | None = None, *, past_timeouts: bool = False) -> ReconcileResult:
        """One pass on ``conn`` (or the reconciler's own connection).  With ``past_timeouts``
        (a worker pool's pass) a step its statement_timeout cancelled is skipped (see the module)."""
        if conn is None:
            if self._slot is None:
                raise RuntimeError("Reconciler.run_once needs a connection or a connect factory")
            conn = self._slot.get()
        result = ReconcileResult()
        now = self.db_now()
        self.step("resume", lambda: self._resume(conn, now, result), result, skip=past_timeouts)
        self.step("reap", lambda: self.reap(conn, now, result), result, skip=past_timeouts)
        self.step("stats", lambda: self._refresh_gauges(queue_stats(conn, self.queues, now=now), result),
                  result, skip=past_timeouts)
        return result

    def step(self, name: Step, work: Callable[[], None], result: ReconcileResult, *, skip: bool) -> None:
        """Run one step.  With ``skip`` (the pool's), one its statement_timeout cancelled is
        logged, noted in ``result.timed_out`` and held off (:data:`HOLD_OFF_FACTOR`): not raised."""
        if not skip:
            work()
            return
        began = self._clock()
        held = self._held_off.get(name)
        if held is not None and began < held.until:
            result.held_off.append(name)
            return
        try:
            work()
        except StatementTimedOut as exc:
            ended = self._clock()
            streak = held.streak + 1 if held is not None else 1
            hold_s = min(HOLD_OFF_FACTOR * (ended - began) * 2 ** min(streak - 1, 16), MAX_HOLD_OFF_S)
            self._held_off[name] = _HeldOff(until=ended + hold_s, streak=streak)
            result.timed_out.append(name)
            self.metrics.reconcile_timed_out.labels(name).inc()
            self.log.warning("reconcile_timed_out", step=name, error=str(exc), waited_s=round(ended - began, 3),
                             next_try_in_s=round(hold_s, 1), in_a_row=streak, hint=_TIMED_OUT_HINT)
            return
        if held is not None:
            del self._held_off[name]
            self.log.info("reconcile_step_recovered", step=name, timed_out_in_a_row=held.streak)

    def reap(self, conn: ConnectionT, now: datetime | None, result: ReconcileResult) -> None:
        """Reap expired leases (one bounded batch) into ``result``."""
        reaped = queue.reap_expired(conn, limit=self.batch, now=now, events_topic=self.events_topic)
        result.requeued_expired, result.failed_expired = record_reaped(reaped, self.metrics, self.log)

    def _resume(self, conn: ConnectionT, now: datetime | None, result: ReconcileResult) -> None:
        for facts, activated in waits.resume_ready(conn, limit=self.batch, now=now,
                                                   events_topic=self.events_topic):
            cause = "activation_lost" if activated else "timeout"
            self.metrics.resumed.labels(facts.queue, cause).inc()
            if activated:
                result.resumed_lost += 1
                self.log.info("activation_recovered", job_id=facts.job_id, queue=facts.queue)
            else:
                result.resumed_timeout += 1

    def _refresh_gauges(self, stats: list[QueueStats], result: ReconcileResult) -> None:
        result.stats = stats
        for s in stats:
            self.metrics.oldest_pending_age.labels(s.queue).set(s.oldest_age_s)
            self.metrics.pending.labels(s.queue).set(s.ready)
            self.metrics.running.labels(s.queue).set(s.running)
            self.metrics.waiting.labels(s.queue).set(s.waiting)

    def start(self) -> None:
        """Run passes every ``interval_s`` on a daemon thread until :meth:`stop`."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="jobs-reconciler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._slot is not None:
            self._slot.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.run_once()
            except OutboxSdkError as exc:
                self.log.warning("reconcile_failed", error=str(exc))
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))


class Upkeep:
    """A worker pool's upkeep between its claims: a reconciler pass every
    ``reconcile_interval_s``, and expired leases reaped at most every ``reap_interval_s``
    in between (not every round: a busy pool claims many rounds a second).  A pass or a
    reap the database refuses (``refusals``: a trigger, a constraint) is not raised: the
    claims go on, the expired jobs wait, and the next try comes after the refusal's
    back-off (:mod:`consumer_sdk.jobs.refusals`).  A step the pool's statement_timeout
    cancels is skipped, the claims go on (``reconcile_timed_out``, see the module)."""

    def __init__(self, reconciler: Reconciler, *, reconcile_interval_s: float, reap_interval_s: float,
                 refusals: Refusals) -> None:
        self.reconciler = reconciler
        self.reconcile_interval_s = reconcile_interval_s
        self.reap_interval_s = reap_interval_s
        self.refusals = refusals
        self.next_reconcile = self.next_reap = 0.0  # monotonic seconds

    def run_due(self, conn: ConnectionT, now: float) -> None:
        """Reconcile, or reap, when due at ``now`` (the pool's monotonic clock)."""
        if now < self.next_reconcile and now < self.next_reap:
            return
        try:
            with self.refusals.watch("reap"):
                self._run_due(conn, now)
        except Refused as refused:
            self.next_reap = max(self.next_reap, now + refused.pause_s)
            self.next_reconcile = max(self.next_reconcile, self.next_reap)

    def _run_due(self, conn: ConnectionT, now: float) -> None:
        rec = self.reconciler
        if now >= self.next_reconcile:
            self.next_reconcile = now + self.reconcile_interval_s
            self.next_reap = now + self.reap_interval_s
            rec.run_once(conn, past_timeouts=True)
        elif now >= self.next_reap:
            self.next_reap = now + self.reap_interval_s
            result = ReconcileResult()
            rec.step("reap", lambda: rec.reap(conn, rec.db_now(), result), result, skip=True)
