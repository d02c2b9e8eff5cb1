"""The worker pool's dispatcher (a part of :class:`consumer_sdk.jobs.worker.WorkerPool`).

One thread: on a wake-up or every ``poll_interval_s``, a round (:meth:`Dispatching.run_once`)
reaps or reconciles when due (:class:`~consumer_sdk.jobs.reconciler.Upkeep`), lists the ready
lanes, plans fairly and claims, in one round trip with the completions of the jobs that
succeeded since the last round, within the bytes ``max_payload_bytes`` leaves; the claimed
jobs go to the pool's line (:meth:`Dispatching._launch`).  Rounds that fail are the outage's
(:mod:`consumer_sdk.jobs.outage`), refusals the refusals' (:mod:`consumer_sdk.jobs.refusals`).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from consumer_sdk.errors import FatalError, OutboxSdkError
from consumer_sdk.jobs import queue as jobq
from consumer_sdk.jobs._conn import ConnSlot, read_only
from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.model import ClaimedJob
from consumer_sdk.jobs.refusals import Refused
from outbox_core.leases import local_deadline

if TYPE_CHECKING:
    from consumer_sdk.jobs.completions import Completions
    from consumer_sdk.jobs.config import WorkerConfig
    from consumer_sdk.jobs.fairness import Limits
    from consumer_sdk.jobs.lanes import Lanes
    from consumer_sdk.jobs.line import Line
    from consumer_sdk.jobs.metrics import JobsMetrics
    from consumer_sdk.jobs.model import JobId
    from consumer_sdk.jobs.outage import Outage
    from consumer_sdk.jobs.reconciler import Upkeep
    from consumer_sdk.jobs.refusals import Refusals


class Dispatching:
    """The dispatcher's loop and rounds (under the pool's lock where they touch the line)."""

    if TYPE_CHECKING:  # the pool's state (consumer_sdk/jobs/worker.py)
        config: WorkerConfig
        log: Any
        worker_id: str
        metrics: JobsMetrics
        rounds: int
        _clock: Callable[[], float]
        _db_now: Callable[[], datetime | None]
        _limits: Limits
        _lanes: Lanes
        _lock: threading.Condition
        _line: Line
        _running: dict[JobId, JobContext]
        _done: Completions
        _refusals: Refusals
        _upkeep: Upkeep
        _outage: Outage
        _dispatch_slot: ConnSlot
        _wake: threading.Event
        _stopping: threading.Event
        _step: str
        _read_only_session: bool
        _next_due: float | None
        _more_work: bool
        _schema_checked: bool
        _bytes_bound: bool
        _dispatching: bool
        _sleeping_until: float

        def _failed(self, exc: FatalError) -> None: ...

    def run_once(self) -> int:
        """One dispatch round: reconcile or reap, then claim fairly into free slots.  A missing
        table met by any of its statements is a refusal of the claim, as in :mod:`.refusals`."""
        self._step = "connect"
        conn = self._dispatch_slot.get()
        if not self._schema_checked or self._refusals.schema_missing("claim"):  # its pass ends that refusal
            self._step = "schema check"
            with self._refusals.watch("claim"):
                jobq.check_schema(conn)
            self._schema_checked = True
        now = self._clock()
        if self._next_due is not None and now >= self._next_due:
            self._next_due = None
            self._lanes.stale.set()
        self._step = "reap or reconcile"
        self._upkeep.run_due(conn, now)
        self._step = "claim (with the completions of the jobs that succeeded)"
        with self._lock:
            held, full, claimed = dict(self._line.held), self._line.total >= self._line.capacity, 0
            room_bytes = self.config.max_payload_bytes - self._line.payload_bytes
            if room_bytes <= 0:  # free slots wait for memory: a job ending wakes the next round
                self._bytes_bound = full = True
        with self._refusals.watch("claim", sent=False):  # the lanes' read, the successes written alone
            if self._stopping.is_set() or full:
                self._more_work = True
                self._done.write_all(conn)  # a round without a claim still writes the successes
            else:
                claimed = self._claim(conn, held, room_bytes)
        self._read_only_session = read_only(conn)
        self.rounds += 1
        return claimed

    def _claim(self, conn: Any, held: dict[str, int], room_bytes: int) -> int:
        lanes = self._lanes.current(conn)
        limits = self._line.ahead if self._line.depth else self._limits
        takes = self._lanes.plan(lanes, busy=held, limits=limits)
        sent_at = self._clock()
        with self._refusals.watch("claim", sent=any(t.n > 0 for t in takes)):  # refused: successes alone first
            claimed = self._done.write_with(lambda done: jobq.complete_and_claim(
                conn, worker=self.worker_id, done=done, takes=takes, lease_s=self.config.lease_duration_s,
                now=self._db_now(), max_bytes=room_bytes), conn=conn, claims=True)
        self._more_work = sum(lane.ready for lane in lanes) > len(claimed)
        if self._lanes.after_round(lanes, takes, claimed, self._done.last_written, limits, sent_at):
            self._wake.set()  # an owner its limit held back has room now: the next round runs at once
        self._launch(claimed, local_deadline(sent_at, self.config.lease_duration_s), room_bytes)
        return len(claimed)

    def _launch(self, claimed: list[ClaimedJob], deadline: float, room_bytes: int) -> None:
        contexts = [JobContext(job, deadline=deadline, db_now=self._db_now) for job in claimed]
        with self._lock:
            for ctx in contexts:
                self._running[ctx.job.id] = ctx
            self._line.add(contexts)
            self._bytes_bound = sum(job.payload_bytes for job in claimed) >= room_bytes
            # Jobs that ended while the claim was on its way saw the last round's flag: their
            # bytes are free now, and the next round must not wait for the poll to take them.
            if self._bytes_bound and self._line.payload_bytes < self.config.max_payload_bytes:
                self._wake.set()
        for queue, n in Counter(job.queue for job in claimed).items():
            self.metrics.per_queue(queue)[0].inc(n)

    def _dispatch_loop(self) -> None:
        pause_s = 0.1
        self._dispatching = True
        while not self._stopping.is_set():
            self._wake.clear()
            began = self._clock()
            try:
                with self._outage.in_flight(began):  # a round that hangs is watched (.outage)
                    self.run_once()
                pause_s = 0.1
                self._outage.passed(read_only_session=self._read_only_session)
            except Refused as refused:  # logged once per cause, counted: no line per round
                self._outage.passed()  # the database answers: the refusal says why not ready
                self._stopping.wait(refused.pause_s)  # no wake-up cuts it short: no spinning
                continue
            except FatalError as exc:  # rejected credentials, a missing grant: a person has to act
                self._dispatching = False  # running jobs write their own completions
                self._failed(exc)  # the outage, if any, ends with the loop: pool.error says why
                break
            except Exception as exc:  # noqa: BLE001 - the loop must survive anything
                if isinstance(exc, OutboxSdkError):  # logged once per outage (.outage): no line per round
                    self._outage.failed(exc, began=began, statement=self._step)
                else:
                    self.log.exception("dispatch_crashed")
                self._stopping.wait(pause_s)
                pause_s = min(pause_s * 2, self.config.poll_interval_s)
                continue
            with self._lock:  # against _complete_later: a success due sooner wakes us
                wait_s = self._wait_s()
                self._sleeping_until = self._clock() + wait_s
            self._wake.wait(wait_s)
        self._dispatching = False
        self._outage.close()
        self._dispatch_slot.close()  # stop() writes what is left on a connection of its own

    def _wait_s(self) -> float:
        """Until the next poll, reconcile, retry due or completion due, whichever comes first."""
        now = self._clock()
        dues = (now + self.config.poll_interval_s, self._upkeep.next_reconcile, self._next_due, self._done.due)
        return max(0.0, min(due for due in dues if due is not None) - now)

    def _retry_scheduled(self, delay_s: float) -> None:
        due = self._clock() + delay_s
        with self._lock:
            self._next_due = due if self._next_due is None else min(self._next_due, due)
        self._wake.set()
