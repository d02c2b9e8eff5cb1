"""The successes of a worker pool's executors, written by the dispatcher's next round.

An executor whose handler returned hands the success here (:meth:`Completions.add`)
and takes its next job; the job stays 'running', leased to the pool (the heartbeat
renews it), until the dispatcher writes the completions of every job that succeeded
since its last round in its claim's statement (:meth:`Completions.write_with`, which
settles them with what the database returned).  A completion is fenced like every
write: a job whose lease was lost meanwhile is settled as ``lost``, and one whose lease
the pool already knows lost (cancelled, unconfirmed) is not written at all.

What a round's statement can meet:

* it passes (the connection broke, a conflict, a cancel, a lock timeout, a shutdown): the
  successes wait for the next round.  When the connection broke the statement may have
  committed all the same, its reply lost (``completions_unconfirmed``): the next round
  sends them again first, on their own (``recheck``), and one found completed by the same
  lease is ``completion_confirmed`` and succeeded, not a lost lease;
* the database refuses a row (:class:`~consumer_sdk.jobs.errors.InvalidJob`: a CHECK, a
  trigger, a value it cannot store): each completion is written alone, and one refused
  again fails its job for good (``permanent_error``, the database's words in its dead
  letter) while the others succeed and the round's claim is made without them.  Sent again
  as it was, the round was refused at every round, for ever (an audit of the pool).

A round's claim whose reply was lost may have committed too: the jobs it claimed run under
the pool's worker id, and the pool knows nothing of them.  The next round gives them back
first (``claims_given_back``: claimable at once, the attempt not counted, see
:func:`~consumer_sdk.jobs.claims.release_unheld`); they waited out their lease before, then
the reaper counted the attempt or, on their last one, dead-lettered them, never run (an
audit of the pool).

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
from datetime import datetime
from typing import Any, TypeVar

from consumer_sdk.errors import OutboxSdkError
from consumer_sdk.jobs import claims, queue
from consumer_sdk.jobs._conn import outcome_unknown
from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.errors import InvalidJob
from consumer_sdk.jobs.events import JobFacts
from consumer_sdk.jobs.executor import NO_AUTHORITY, trace_id
from consumer_sdk.jobs.metrics import JobsMetrics
from consumer_sdk.jobs.model import JobId
from consumer_sdk.jobs.queue import Done
from consumer_sdk.jobs.retry import describe, error_type

T = TypeVar("T")
#: The results' characters one round writes at most (PostgreSQL caps the statement's jsonb
#: array of completions at 256 MB: two results of 140 MB failed it at every round, for ever).
MAX_ROUND_CHARS = 32 * 1024 * 1024
#: Writes these completions (and maybe more): (the facts of the jobs completed, the rest).
Write = Callable[[Sequence[Done]], tuple[Mapping[JobId, JobFacts], T]]


class Pending:
    """A success waiting for its completion; ``unconfirmed`` once a statement that carried
    it failed with its outcome unknown (the connection broke: it may have committed)."""

    __slots__ = ("ctx", "done", "duration_s", "unconfirmed")

    def __init__(self, ctx: JobContext, done: Done, duration_s: float) -> None:
        self.ctx, self.done, self.duration_s = ctx, done, duration_s
        self.unconfirmed = False


class Completions:
    """Successes waiting for a round, oldest first, and when the oldest must be written."""

    def __init__(self, *, lock: threading.Condition, running: dict[JobId, JobContext], metrics: JobsMetrics,
                 log: Any, outcomes: Counter[str], clock: Callable[[], float], within_s: float,
                 worker_id: str = "", db_now: Callable[[], datetime | None] = lambda: None) -> None:
        self._lock = lock
        self._running = running
        self.metrics = metrics
        self.log = log
        self.outcomes = outcomes
        self._clock = clock
        self.within_s = within_s
        self.worker_id = worker_id
        self._db_now = db_now
        self._pending: list[Pending] = []
        self._chars = 0  # the pending results' characters
        #: When the oldest success must be written at the latest (None: none waits).
        self.due: float | None = None
        #: The owners of the jobs the last write (write_with) completed, with how many each.
        self.last_written: Counter[str] = Counter()
        #: A claim's reply was lost (see the module): the next write gives back what it claimed.
        self.claim_unconfirmed = False

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

    def write_all(self, conn: Any) -> None:
        """Write every waiting success on ``conn`` (a round that claims nothing)."""
        if self._pending:
            self.write_with(lambda done: (claims.complete_many(conn, worker=self.worker_id, done=done,
                                                               now=self._db_now()), None), conn=conn)

    def write_final(self, slot: Any) -> None:
        """When the pool stops: the successes still waiting, on ``slot`` (a ConnSlot: three
        tries, then they are left to their leases and run again), closed at the end."""
        try:
            for _ in range(3):
                try:
                    self.write_all(slot.get())
                    return
                except OutboxSdkError as exc:
                    self.log.warning("completions_failed", error=str(exc), jobs=len(self))
                    slot.close()
        finally:
            slot.close()

    def write_with(self, write: Write[T], *, conn: Any = None, claims: bool = False) -> T:
        """Take every waiting success, ``write`` them and settle them; put them back first in
        line if ``write`` raises, except a refusal of a row: then, with ``conn``, each is
        written alone on it (see the module) and ``write`` runs again without them.  Those
        whose earlier write may have committed are written first on ``conn``, on their own;
        so are the jobs an earlier write that ``claims`` may have claimed given back."""
        if self.claim_unconfirmed and conn is not None:
            self._give_back_unheld(conn)
        with self._lock:
            pending, self._pending, self.due, self._chars = self._pending, [], None, 0
        self.last_written = Counter()
        # Not written at all: the pool knows their lease lost (unless an earlier write of
        # theirs may have committed: then the database says which).
        known_lost = [p.ctx.cancel_reason in NO_AUTHORITY and not p.unconfirmed for p in pending]
        if any(known_lost):
            self.settle([p for p, gone in zip(pending, known_lost, strict=True) if gone], {})
            pending = [p for p, gone in zip(pending, known_lost, strict=True) if not gone]
        for p in pending:  # from here the write, not the heartbeat, says whether the lease held
            p.ctx.ending = True
        try:
            if conn is not None and any(p.unconfirmed for p in pending):
                pending = self._confirm(conn, pending)
            facts, rest = write([p.done for p in pending])
        except InvalidJob:
            if not pending or conn is None:
                self._put_back(pending)
                raise
            self._write_each(conn, pending)
            return write([])[1]
        except BaseException as exc:
            unknown = outcome_unknown(exc, conn)
            self.claim_unconfirmed = self.claim_unconfirmed or (claims and unknown)
            self._put_back(pending, unconfirmed=unknown, error=exc)
            raise
        self.settle(pending, facts)
        return rest

    def _give_back_unheld(self, conn: Any) -> None:
        """A claim's reply was lost: give back the jobs running under this worker that the
        pool does not hold (see the module).  The pool's claims are all made by the thread
        that calls this, so every job it claimed and knows of is in ``running``."""
        with self._lock:
            held = list(self._running)
        try:
            released = claims.release_unheld(conn, worker=self.worker_id, held=held, now=self._db_now())
        except InvalidJob as exc:  # a trigger, a constraint: left to their leases, as before
            self.log.warning("claims_not_given_back", error=str(exc))
            released = []
        self.claim_unconfirmed = False
        if released:
            self.log.warning("claims_given_back", jobs=len(released), job_ids=[int(i) for i in released[:20]],
                             detail="a claim's reply was lost (the connection broke): the jobs it claimed are "
                                    "given back, their attempt not counted, for the next claim")

    def _put_back(self, pending: list[Pending], *, unconfirmed: bool = False,
                  error: BaseException | None = None) -> None:
        """First in line again, for the next round.  ``unconfirmed``: the statement that carried
        them may have committed (its reply lost): the next one asks the database."""
        if not pending:
            return
        for p in pending:
            p.unconfirmed = p.unconfirmed or unconfirmed
            p.ctx.ending = p.unconfirmed  # not written, unless an earlier write may have been
        if unconfirmed:
            self.log.warning("completions_unconfirmed", jobs=len(pending), error=str(error),
                             job_ids=[int(p.ctx.job.id) for p in pending[:20]],
                             detail="the connection broke while they were being written: the next round "
                                    "finds out whether they were")
        with self._lock:
            self._pending[:0] = pending
            self._chars += sum(len(p.done.result_json) for p in pending)
            self.due = self._clock() + self.within_s

    def _confirm(self, conn: Any, pending: list[Pending]) -> list[Pending]:
        """Write (and settle) the completions whose earlier write may have committed, asking
        the database whether it did; the others, to write as usual."""
        unconfirmed = [p for p in pending if p.unconfirmed]
        written = claims.complete_many(conn, worker=self.worker_id, done=[p.done for p in unconfirmed],
                                       now=self._db_now(), recheck=True)
        self.settle(unconfirmed, written)
        return [p for p in pending if not p.unconfirmed]

    def _write_each(self, conn: Any, pending: list[Pending]) -> None:
        """The database refused a round that carried these: each alone, a refused one failed."""
        for i, p in enumerate(pending):
            try:
                try:
                    written = claims.complete_many(conn, worker=self.worker_id, done=[p.done],
                                                   now=self._db_now(), recheck=p.unconfirmed)
                except InvalidJob as exc:
                    self._refused(conn, p, exc)
                else:
                    self.settle([p], written)
            except BaseException as exc:
                self._put_back(pending[i:], unconfirmed=outcome_unknown(exc, conn), error=exc)
                raise

    def _refused(self, conn: Any, p: Pending, exc: InvalidJob) -> None:
        """The database refuses this completion, and would again: the job fails for good."""
        job = p.ctx.job
        self.log.warning("job_failed", job_id=job.id, queue=job.queue, kind=job.kind, attempt=job.attempts,
                         reason="permanent_error", error=describe(exc, limit=300),
                         detail="the database refused the job's completion")
        try:
            facts = queue.fail(conn, p.ctx.lease, reason="permanent_error", error=describe(exc),
                               error_type=error_type(exc), now=self._db_now())
        except InvalidJob as again:  # a trigger refusing every change of the row: nothing can be written
            self.log.error("job_write_refused", job_id=job.id, error=str(again),
                           hint="neither its completion nor its failure could be written: it is left to its lease")
            self._finish(p, "lost", "write_rejected")
            return
        if facts is None:
            self._finish(p, "lost", "write_refused")
            return
        self.metrics.dead_lettered.labels(facts.queue, "permanent_error").inc()
        self.metrics.observe_terminal(facts.queue, "failed", age_s=facts.age_s, attempts=facts.attempts)
        self._finish(p, "failed", None)

    def settle(self, pending: list[Pending], facts: Mapping[JobId, JobFacts]) -> None:
        """Account for written completions (in ``facts``: their owners counted in
        ``last_written``) and refused ones (lost)."""
        confirmed: frozenset[JobId] = getattr(facts, "confirmed", frozenset())
        for p in pending:
            job = p.ctx.job
            found = facts.get(job.id)
            if found is not None:
                self.metrics.observe_terminal(found.queue, "succeeded", age_s=found.age_s,
                                              attempts=found.attempts)
                if job.id in confirmed:
                    self.log.info("completion_confirmed", job_id=job.id, token=job.token,
                                  detail="an earlier statement had written it: its reply was lost")
                self.last_written[job.owner_id] += 1
                self._finish(p, "succeeded", None)
                continue
            if p.ctx.cancel_reason is None:  # else the heartbeat said so already (before it was sent)
                self.log.warning("lease_lost", job_id=job.id, token=job.token,
                                 detail="the completion matched no row")
            self._finish(p, "lost", p.ctx.cancel_reason or "write_refused")

    def _finish(self, p: Pending, outcome: str, reason: str | None) -> None:
        job = p.ctx.job
        if outcome == "lost":
            self.metrics.leases_lost.labels(job.queue, reason or "write_refused").inc()
        self.outcomes[outcome] += 1
        self.log.info("job_attempt_finished", job_id=job.id, queue=job.queue, kind=job.kind,
                      attempt=job.attempts, token=job.token, trace_id=trace_id(job.traceparent),
                      outcome=outcome, duration_s=round(p.duration_s, 4), reason=reason)
        with self._lock:
            self._running.pop(job.id, None)
