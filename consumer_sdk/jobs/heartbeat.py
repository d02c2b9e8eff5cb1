"""A worker pool's heartbeat: every running attempt's lease renewed in one statement.

Every ``heartbeat_interval_s`` the pool's heartbeat thread calls :meth:`Heartbeat.once`:
one statement renews the leases of every attempt the pool holds (running a handler, or
succeeded and waiting for its completion).  An attempt not renewed is cancelled
cooperatively (its handler's ``ctx.check()`` raises LeaseLost) and nothing more is
written for it; when the database cannot be reached, an attempt is cancelled once its
local deadline passes.  A renewed attempt inside a fenced transaction gets a keep-alive
on its own connection (off this thread, which must never wait for a handler's statement).

An attempt whose outcome was sent (``ctx.ending``) is neither cancelled nor called lost: its
own write may be what ended the lease (the dispatcher's round wrote its success, the executor its retry or dead letter,
after the heartbeat took the attempt and before its statement ran, or while its UPDATE
waited for the row that write had locked, its snapshot then showing the job running).  The
heartbeat called such a lease lost (``lease_lost``) for an outcome its own lease wrote (an
audit of the pool).  That write is fenced: it says whether the lease held, and one that
found it lost logs ``lease_lost`` and counts it; the heartbeat leaves the attempt to it
(its lease is still renewed while the job runs: a completion waiting to be sent again).

Renewing a lease says the worker lives, not that its handler makes progress: a handler that
never returns (an HTTP call without a timeout, a deadlock) kept its job and its slot for
ever, silently (an audit of the pool).  So the lease watch also logs ``job_running_long``
once per attempt whose handler has run ``running_long_after_s``, and the gauge
``outbox_jobs_oldest_running_age_seconds{queue}`` says, when scraped, how long the oldest
handler of the pool has run (from the pool's own attempts: no statement);
``outbox_jobs_handlers_stuck`` how many handlers timed out (``handler_timeout_s``) have not
returned, each holding a thread and a slot (:mod:`consumer_sdk.jobs.timeouts`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from functools import partial
from typing import Any

from consumer_sdk.errors import OutboxSdkError
from consumer_sdk.jobs import queue as jobq
from consumer_sdk.jobs._conn import ConnSlot
from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.metrics import JobsMetrics
from consumer_sdk.jobs.model import JobId
from consumer_sdk.jobs.timeouts import HandlerTimeouts
from outbox_core.leases import local_deadline


class Heartbeat:
    """Renews the leases of ``running()``; owns its connection and the keep-alive threads."""

    def __init__(self, *, slot: ConnSlot, worker_id: str, lease_s: float, max_concurrency: int,
                 running: Callable[[], list[JobContext]], metrics: JobsMetrics, log: Any,
                 clock: Callable[[], float], db_now: Callable[[], datetime | None],
                 queues: Sequence[str] = (), running_long_s: float = float("inf"),
                 timeouts: HandlerTimeouts | None = None) -> None:
        self._slot = slot
        self.worker_id = worker_id
        self.lease_s = lease_s
        self._running = running
        self.metrics = metrics
        self.log = log
        self._clock = clock
        self._db_now = db_now
        self._lock = threading.Lock()
        self._keepalive_pool = ThreadPoolExecutor(max_workers=max(1, min(4, max_concurrency)),
                                                  thread_name_prefix="jobs-fence-keepalive")
        self._keepalives: dict[JobId, Future[bool]] = {}
        self.running_long_s = running_long_s
        self.timeouts = timeouts
        for queue in queues:  # read when scraped: no update per job
            metrics.oldest_running_age.labels(queue).set_function(partial(self.oldest_running_s, queue))
        metrics.handlers_stuck.set_function(self.stuck_handlers)

    def loop(self, every_s: float, stop: threading.Event) -> None:
        watch = threading.Thread(target=self._watch, args=(every_s, stop), name="jobs-lease-watch", daemon=True)
        watch.start()
        try:
            while not stop.wait(every_s):
                self.once()
            if self.timeouts is not None:  # a timed-out failure whose reply was lost: asked once more
                self.timeouts.finish(self._slot.get)
        finally:
            self._slot.close()

    def _watch(self, every_s: float, stop: threading.Event) -> None:
        """Cancel the attempts whose local deadline passed, without the database.  The
        heartbeat did that only once its statement failed: in a partition that drops packets
        the statement waited for TCP, for many minutes, and the handlers ran on while
        another worker had taken their jobs (an audit of the worker pool)."""
        while not stop.wait(min(every_s, 0.5)):
            self.expire_overdue()
            self.report_long()

    def oldest_running_s(self, queue: str, now: float | None = None) -> float:
        """How long the oldest handler of ``queue`` this pool runs has run (0.0: none runs)."""
        now = time.monotonic() if now is None else now
        running = self._running() + (self.timeouts.stuck() if self.timeouts is not None else [])
        since = [s for c in running if c.job.queue == queue and (s := c.running_since) is not None]
        return max(0.0, now - min(since)) if since else 0.0

    def report_long(self, now: float | None = None) -> int:
        """Log ``job_running_long`` once per attempt whose handler has run ``running_long_s``
        (``time.monotonic()`` seconds, as the executor's ``running_since``); returns how many."""
        now = time.monotonic() if now is None else now
        count = 0
        for ctx in self._running():
            since = ctx.running_since
            if since is None or ctx.long_reported or now - since < self.running_long_s:
                continue
            ctx.long_reported = True
            job = ctx.job
            self.log.warning("job_running_long", job_id=job.id, queue=job.queue, kind=job.kind,
                             attempt=job.attempts, token=job.token, running_s=round(now - since, 1),
                             detail=f"the handler has run for {now - since:.0f} s and not returned; its "
                                    "lease is still renewed, so the job and its worker slot stay taken "
                                    "until it returns (see outbox_jobs_oldest_running_age_seconds)")
            count += 1
        return count

    def expire_overdue(self) -> int:
        """Cancel the running attempts past their local deadline (``lease_unconfirmed``)."""
        now = self._clock()
        return sum(self._lose(c, "lease_unconfirmed") for c in self._running()
                   if not c.cancelled and now >= c.deadline)

    def stuck_handlers(self) -> int:
        """Handlers timed out that have not returned (each holds its thread and slot)."""
        return len(self.timeouts.stuck()) if self.timeouts is not None else 0

    def close(self) -> None:
        self._keepalive_pool.shutdown(wait=False, cancel_futures=True)

    def forget(self, job_id: JobId) -> None:
        """The attempt's handler ended: no keep-alive is pending for it any more."""
        if job_id not in self._keepalives:  # the usual case, without the lock
            return
        with self._lock:
            self._keepalives.pop(job_id, None)

    def once(self) -> int:
        """Renew every running job's lease; cancel the attempts that lost it.  Returns how many.
        First the handlers past ``handler_timeout_s`` are timed out (:mod:`.timeouts`): their
        failures are written on this connection, their leases not renewed any more."""
        if self.timeouts is not None:
            self.timeouts.run(self._slot.get, self._running())
        contexts = [c for c in self._running() if not c.cancelled or c.cancel_reason == "shutdown"]
        if not contexts:
            return 0
        sent_at = self._clock()
        try:
            lost = jobq.heartbeat(self._slot.get(), worker=self.worker_id, leases=[c.lease for c in contexts],
                                  lease_s=self.lease_s, now=self._db_now())
        except OutboxSdkError as exc:
            self.metrics.heartbeat_failures.inc()
            self.log.warning("heartbeat_failed", error=str(exc), jobs=len(contexts))
            return self.expire_overdue()
        deadline = local_deadline(sent_at, self.lease_s)
        count = 0
        for ctx in contexts:
            if ctx.job.id in lost:
                count += self._lose(ctx, "cancelled" if lost[ctx.job.id] == "cancelled" else "lease_lost")
            else:
                ctx.deadline = deadline
                self._keep_fence_alive(ctx)
        return count

    def _keep_fence_alive(self, ctx: JobContext) -> None:
        """The lease was renewed: let the job's open fenced transaction live on."""
        if not ctx.in_fenced_transaction:
            return
        with self._lock:
            pending = self._keepalives.get(ctx.job.id)
            if pending is not None and not pending.done():
                return
            self._keepalives[ctx.job.id] = self._keepalive_pool.submit(ctx.keep_fence_alive)

    def _lose(self, ctx: JobContext, reason: str) -> int:
        if ctx.ending or not ctx.cancel(reason):  # ending: its outcome's write says (see the module)
            return 0
        self.log.warning("lease_lost", job_id=ctx.job.id, token=ctx.job.token, reason=reason)
        return 1
