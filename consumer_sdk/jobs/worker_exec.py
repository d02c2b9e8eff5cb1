"""The worker pool's executors (a part of :class:`consumer_sdk.jobs.worker.WorkerPool`).

``max_concurrency`` threads, each with a connection of its own: one claimed job at a time
from the pool's line (:mod:`consumer_sdk.jobs.line`: one lock section finishes a job and
takes the next), its handler run by :class:`~consumer_sdk.jobs.executor.Executor` on the
executor's connection; a success is handed to the dispatcher's next round
(:meth:`Executing._complete_later`), every other outcome written by the executor.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from consumer_sdk.errors import OutboxSdkError
from consumer_sdk.jobs._conn import ConnSlot
from consumer_sdk.jobs.context import JobContext

if TYPE_CHECKING:
    from consumer_sdk.jobs.completions import Completions
    from consumer_sdk.jobs.config import WorkerConfig
    from consumer_sdk.jobs.executor import Executor
    from consumer_sdk.jobs.heartbeat import Heartbeat
    from consumer_sdk.jobs.line import Line
    from consumer_sdk.jobs.model import JobId
    from consumer_sdk.jobs.refusals import Refusals


class Executing:
    """The executors' loop, and how a finished job frees its place (under the pool's lock)."""

    if TYPE_CHECKING:  # the pool's state (consumer_sdk/jobs/worker.py)
        config: WorkerConfig
        log: Any
        outcomes: Counter[str]
        _connect: Any
        _lock: threading.Condition
        _line: Line
        _running: dict[JobId, JobContext]
        _done: Completions
        _executor: Executor
        _hb: Heartbeat
        _refusals: Refusals
        _wake: threading.Event
        _stopping: threading.Event
        _wake_free: int
        _more_work: bool
        _bytes_bound: bool
        _dispatching: bool
        _sleeping_until: float

    def _executor_loop(self) -> None:
        with ConnSlot(self._connect, idle_ms=self.config.idle_in_transaction_ms) as slot:
            ended: tuple[JobContext, float] | None = None  # the job just run: finished with the next take
            try:
                while True:
                    with self._lock:  # one section a job: finish the last one, take the next
                        wake = ended is not None and self._finish_locked(*ended) and not self._wake.is_set()
                        ended, ctx = None, None if wake else self._line.take()
                    if wake:  # none pending (else its round sees this): outside the lock, before take()
                        self._wake.set()
                        with self._lock:
                            ctx = self._line.take()
                    if ctx is None:
                        return
                    started = time.monotonic()
                    try:
                        self._execute(ctx, slot)
                    finally:
                        slot.tidy()
                        self._hb.forget(ctx.job.id)
                        ended = ctx, time.monotonic() - started
            finally:
                if ended is not None:  # a BaseException left the loop (the next poll sees the place)
                    with self._lock:
                        self._finish_locked(*ended)

    def _execute(self, ctx: JobContext, slot: ConnSlot) -> None:
        try:
            ctx.bind(slot.get(), reconnect=slot.get)
        except OutboxSdkError as exc:  # the lease will expire and the job be retried
            self.log.warning("job_not_started", job_id=ctx.job.id, error=str(exc))
            self.outcomes["not_started"] += 1
            return
        try:
            outcome = self._executor.give_back(ctx) if ctx.cancelled else self._executor.run(ctx)
            if outcome != "completing":  # counted when written
                self.outcomes[outcome] += 1
        except Exception:  # noqa: BLE001 - an executor thread must survive anything
            self.log.exception("job_executor_crashed", job_id=ctx.job.id)

    def _finish_locked(self, ctx: JobContext, duration_s: float) -> bool:
        """A handler ended (under the lock); True when the dispatcher should be woken."""
        if not ctx.completing and self._running.get(ctx.job.id) is ctx:  # else claimed again (timed out)
            del self._running[ctx.job.id]
        self._line.done(ctx, duration_s)  # its payload bytes are free (the one place: any outcome)
        free, idle = self._line.capacity - self._line.total, self._line.total == 0
        # A round for several free places rather than one per finished job (with a line:
        # when half of it is gone); never leave every slot idle (nor a success) waiting.
        enough = free >= (self.config.max_concurrency if self._line.depth else self._wake_free)
        # The pool waited for memory (max_payload_bytes), not for slots: these bytes let it claim.
        memory = self._bytes_bound and self._line.payload_bytes < self.config.max_payload_bytes
        if idle:
            self._lock.notify_all()
        return not self._stopping.is_set() and (self._more_work or ctx.completing) and (enough or idle or memory)

    def _complete_later(self, ctx: JobContext, result_json: str, duration_s: float) -> bool:
        """The executor's success, written by the next round (False: write it yourself)."""
        if not self._dispatching or self._stopping.is_set() or self._refusals.refusing("claim"):
            return False  # no round comes soon: the executor writes it
        with self._lock:  # the dispatcher computes its wait under it: it saw `due`, or we see its wait
            if wake := self._done.add(ctx, result_json, duration_s, wake_before=self._sleeping_until):
                self._wake.set()
        return wake is not None  # None: too large for a round, written alone by the executor
