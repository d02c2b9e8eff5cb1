"""The worker pool: claims fairly, runs handlers on threads, renews leases, stops cleanly.

Threads, each with its own connection:

* the dispatcher (:mod:`.worker_dispatch`): on a wake-up (NOTIFY, a relayed event via :meth:`WorkerPool.wake`,
  finished jobs while work is left, a retry falling due) or every ``poll_interval_s``,
  reaps expired leases (at most every quarter lease or poll interval), lists the ready
  lanes (:mod:`consumer_sdk.jobs.lanes`: every owner in turn), plans with :mod:`consumer_sdk.jobs.fairness`
  and claims in one short transaction, in the same round trip as the completions of the jobs that
  succeeded since the last round, with the bytes ``max_payload_bytes`` leaves (the held jobs'
  ``payload_bytes`` counted by the line until their attempts end; none left: no claim, and a job
  ending wakes the next round); runs the reconciler every ``reconcile_interval_s`` (:mod:`.refusals`);
* ``max_concurrency`` executors (:mod:`.worker_exec`): one claimed job at a time, from the pool's line
  (:mod:`consumer_sdk.jobs.line`: short jobs are claimed ahead; one lock section finishes a
  job and takes the next), the handler on the executor's connection (see
  :class:`~consumer_sdk.jobs.context.JobContext`); a success is handed to the dispatcher
  (its lease still held and renewed); every other outcome is written by the executor;
* the heartbeat (:mod:`consumer_sdk.jobs.heartbeat`): every ``heartbeat_interval_s`` one statement renews
  the pool's leases; an attempt that lost one, passed its local deadline or timed out, is cancelled;
* the listener (``listen=True``): LISTEN outbox_jobs, a wake-up per notification;
* two watches, each its own thread: the lock-wait watch (``jobs-lock-waits``, :mod:`.lock_waits`)
  and the outage's round in flight (``jobs-dispatch-watch``, :mod:`.outage`).  Not one: the
  lock-wait watch's look waits on the database (its connect, its statement), and in a partition
  the round's ``dispatch_unanswered`` would wait behind it.

Completions are written per round: see :mod:`consumer_sdk.jobs.completions` on crashes.  Rounds
that fail because the database is unavailable or read-only are an outage (:mod:`consumer_sdk.jobs.outage`:
logged once, not ready after two rounds and two seconds, ``outbox_jobs_database_unavailable``), as is a
round unanswered for ten seconds (a partition that drops packets; not a lock wait).

Every connection the pool opens carries TCP keep-alives and a ``tcp_user_timeout`` of one
lease (:func:`consumer_sdk.jobs._conn.tcp_options`; the DSN's own values win): in a partition
that drops packets, a statement fails after about a lease, not the kernel's 15 minutes.  The
pool's own sessions (the dispatcher's, the heartbeat's, the lock-wait watch's; not the executors',
whose sessions are the handlers') run with ``statement_timeout`` = ``pool_statement_timeout_s``.

No transaction is ever held while a handler runs, except the handler's own fenced
transactions (a handler past ``handler_timeout_s``: :mod:`consumer_sdk.jobs.timeouts`).
Lifecycle: :meth:`start`, :meth:`run_once` (one dispatch round; returns the number of jobs
claimed), :meth:`stop` (idempotent: stops claiming, lets running jobs finish for
``drain_timeout_s``, then cancels them and gives their jobs back; returns within
``drain_timeout_s`` + :data:`STOP_GRACE_S` whatever the database does).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import datetime
from functools import partial
from typing import Any

import structlog

from consumer_sdk.errors import FatalError
from consumer_sdk.jobs import queue as jobq
from consumer_sdk.jobs._conn import (
    ConnectionFactory,
    ConnSlot,
    PoolerAware,
    pool_connect_factory,
    watch_connect,
)
from consumer_sdk.jobs.completions import Completions
from consumer_sdk.jobs.config import WorkerConfig, check_pool_arguments
from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.executor import Executor, Handler
from consumer_sdk.jobs.heartbeat import Heartbeat
from consumer_sdk.jobs.lanes import Lanes
from consumer_sdk.jobs.line import Line
from consumer_sdk.jobs.lock_waits import PoolLockWaitWatch
from consumer_sdk.jobs.metrics import JobsMetrics
from consumer_sdk.jobs.model import JobId
from consumer_sdk.jobs.outage import Outage
from consumer_sdk.jobs.reconciler import Reconciler, Upkeep
from consumer_sdk.jobs.refusals import PoolHealth, Refusals
from consumer_sdk.jobs.threads import PoolThreads, left
from consumer_sdk.jobs.timeouts import HandlerTimeouts
from consumer_sdk.jobs.wake import Listener
from consumer_sdk.jobs.worker_dispatch import Dispatching
from consumer_sdk.jobs.worker_exec import Executing

#: stop() returns at most this long after the drain (``drain_timeout_s``), whatever the database
#: does: for the cancelled handlers to give their jobs back, the last completions, the heartbeat
#: and the listener; threads still waiting on the database are let go in its last _LET_GO_S.
STOP_GRACE_S = 5.0
_LET_GO_S = 0.5
#: How long the dispatcher plans from the lanes it last read (updated by its own claims)
#: before asking the database again; listing lanes is the costliest statement of a round.
_LANES_TTL_S = 0.25
#: A success waits at most this long for a round to write its completion.
_COMPLETE_WITHIN_S = 0.02


class WorkerPool(Dispatching, Executing):
    """Runs the handlers of ``config.queues``; ``handlers`` maps a job kind to its handler."""

    def __init__(self, config: WorkerConfig, handlers: Mapping[str, Handler], *,
                 metrics: JobsMetrics | None = None, log: Any = None,
                 connect: ConnectionFactory | None = None, clock: Callable[[], float] = time.monotonic,
                 db_now: Callable[[], datetime | None] = lambda: None,
                 rand: Callable[[], float] = random.random) -> None:
        self.config = check_pool_arguments(config, handlers, metrics)
        self.worker_id = config.worker_id or jobq.new_worker_id()
        self.metrics = metrics if metrics is not None else JobsMetrics()
        self.log = (log if log is not None else structlog.get_logger("consumer_sdk.jobs.worker")).bind(
            worker=self.worker_id)
        self._connect = PoolerAware(connect or pool_connect_factory(config))
        self._clock, self._db_now = clock, db_now
        self._limits = config.limits
        self._lanes = Lanes(queues=config.queues, max_owners=config.max_owners_per_round,
                            ttl_s=min(_LANES_TTL_S, config.poll_interval_s), clock=clock, db_now=db_now)
        self._executor = Executor(handlers=handlers, backoff=config.backoff, metrics=self.metrics,
                                  log=self.log, events_topic=config.events_topic, db_now=db_now,
                                  on_retry=self._retry_scheduled, rand=rand,
                                  complete_later=self._complete_later, on_fatal=self._failed,
                                  max_interruptions=config.max_interruptions)
        self.reconciler = Reconciler(queues=config.queues, metrics=self.metrics, log=self.log,
                                     events_topic=config.events_topic, db_now=db_now, clock=clock)
        self.outcomes: Counter[str] = Counter()
        lock = threading.RLock()
        self._lock = threading.Condition(lock)  # stop() waits on it for an idle line
        #: Every attempt whose lease this pool holds: lined up, running, or completing.
        self._running: dict[JobId, JobContext] = {}
        self._line = Line(queues=config.queues, limits=config.limits, ready=threading.Condition(lock))
        #: Successes waiting for the next round (see _complete_later).
        self._done = Completions(lock=self._lock, running=self._running, metrics=self.metrics, log=self.log,
                                 outcomes=self.outcomes, clock=clock, within_s=_COMPLETE_WITHIN_S,
                                 worker_id=self.worker_id, db_now=db_now)
        self._sleeping_until = 0.0  # when the dispatcher wakes up at the latest
        self._dispatching = False  # the dispatcher loop runs (else executors complete their jobs)
        self._wake, self._stopping, self._hb_stop = threading.Event(), threading.Event(), threading.Event()
        own_ms = config.pool_statement_timeout_ms  # the pool's own statements' statement_timeout (0: none)
        self._dispatch_slot = ConnSlot(self._connect, idle_ms=config.idle_in_transaction_ms, statement_ms=own_ms)
        self._listener = Listener(self._connect, self.wake, log=self.log) if config.listen else None
        self._threads = PoolThreads()
        self._wake_free = max(1, config.max_concurrency // 4)  # free slots worth a round
        #: Expired leases are reaped at most every quarter lease (and at every reconcile): little delay.
        self._refusals = refusals = Refusals(log=self.log, rand=rand, metrics=self.metrics)
        self._upkeep = Upkeep(self.reconciler, reconcile_interval_s=config.reconcile_interval_s, refusals=refusals,
                              reap_interval_s=min(config.poll_interval_s, config.lease_duration_s / 4))
        #: The dispatcher's rounds failed in a row for the database (unavailable, read-only).
        self._outage = Outage(log=self.log, metrics=self.metrics, clock=clock,
                              lock_wait_s=lambda: self.lock_waits.last_wait_s)
        self._step = "connect"  # what the dispatcher's round does now (its failure's ``statement``)
        self._read_only_session = False  # the last round ran on a read-only session (it proved nothing)
        self._next_due: float | None = None
        self._more_work = self._schema_checked = False
        #: The last round met max_payload_bytes (claimed up to it, or nothing for it): a job
        #: ending under it wakes the next round (worker_exec), free slots or not.
        self._bytes_bound = False
        self._started = self._stopped = False
        #: The fatal error that stopped claiming (AuthenticationFailed, ...), else None.
        self.error: FatalError | None = None
        hb_slot = ConnSlot(self._connect, idle_ms=config.idle_in_transaction_ms, statement_ms=own_ms)
        self._hb = Heartbeat(slot=hb_slot, worker_id=self.worker_id, lease_s=config.lease_duration_s, queues=config.queues,
                             max_concurrency=config.max_concurrency, running=self.running, metrics=self.metrics,
                             log=self.log, clock=clock, db_now=db_now, running_long_s=config.running_long_after_s,
                             timeouts=HandlerTimeouts(config, self._executor, self.outcomes, self.log))
        self.rounds = 0  # dispatch rounds completed (tests wait on it)
        #: Names what the dispatcher's and the heartbeat's statements wait on (jobs_lock_wait).
        self.lock_waits = PoolLockWaitWatch.of_slots(watch_connect(self._connect, statement_ms=own_ms),
                                                     dispatcher=self._dispatch_slot, heartbeat=hb_slot,
                                                     metrics=self.metrics, queues=config.queues, log=self.log)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the threads (idempotent).  Database trouble is retried, never raised here."""
        if self._started:
            return
        self._started = True
        self._connect.probe(self.log)
        self.metrics.workers_capacity.set(self.config.max_concurrency)
        self.metrics.payload_bytes_limit.set(self.config.max_payload_bytes)
        self.metrics.payload_bytes_held.set_function(lambda: self._line.payload_bytes)
        for queue in self.config.queues:  # read when scraped: no update per job
            self.metrics.workers_busy.labels(queue).set_function(partial(self._line.running.__getitem__, queue))
            self.metrics.serve(queue)  # every give-back cause at 0: increase() sees the first
        for i in range(self.config.max_concurrency):
            self._threads.start("executor", self._executor_loop, f"jobs-exec-{i}")
        self._threads.start("heartbeat", lambda: self._hb.loop(self.config.heartbeat_every_s, self._hb_stop),
                            "jobs-heartbeat")
        self._threads.start("dispatch", self._dispatch_loop, "jobs-dispatch")
        self.lock_waits.start()
        if self._listener is not None:
            self._listener.start()
        self.log.info("pool_started", queues=list(self.config.queues),
                      max_concurrency=self.config.max_concurrency, lease_s=self.config.lease_duration_s)

    @property
    def listening(self) -> bool:
        """True while the LISTEN connection is up (always False with ``listen=False``)."""
        return self._listener is not None and self._listener.connected.is_set()

    def wake(self, queue: str | None = None) -> None:
        """Claim now instead of at the next poll (any thread, any time; cheap)."""
        if queue is None or queue in self.config.queues:
            self._lanes.stale.set()  # new work the cached lanes do not know
            self._wake.set()

    def stop(self, *, drain_timeout_s: float | None = None) -> None:
        """Stop claiming, drain, give back what is left; idempotent.

        Returns within ``drain_timeout_s`` (the config's by default) + :data:`STOP_GRACE_S`
        whatever the database does, answering or not: a phase waits only for the time left,
        and the threads still waiting on the database at the end have their connections
        shut down (``pool_stop_abandoned``), so they end at once; what they were writing is
        left to the leases.  (Waiting on each thread in turn, a pool behind a partition took
        46 s to stop: an audit of the pool.)"""
        if self._stopped:
            return
        self._stopped = True
        drain = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        end = time.monotonic() + drain + STOP_GRACE_S
        until = end - _LET_GO_S
        self._stopping.set()
        self._wake.set()
        self._threads.join("dispatch", min(until, time.monotonic() + STOP_GRACE_S))  # a round is short
        if not self._wait_idle(min(drain, left(until))):
            with self._lock:
                running = [ctx for ctx in self._running.values() if not ctx.completing]
            for ctx in running:
                ctx.cancel("shutdown")  # lined-up jobs are given back without running
            self._wait_idle(left(until))
        with self._lock:
            self._line.close()
        self._threads.join("executor", until)
        if len(self._done) and not self._threads.running("dispatch"):  # else its connection is its own
            self._threads.start("final", partial(self._done.write_final, self._dispatch_slot),
                                "jobs-stop-completions")  # the database may not answer: not here
            self._threads.join("final", until)
        self._hb_stop.set()
        self._threads.join("heartbeat", until)
        self.lock_waits.stop(min(1.0, left(until)))
        if self._listener is not None:
            self._listener.stop(left(until))
        self._threads.let_go(self._connect, self.log, end, [getattr(self._listener, "thread", None)])
        self._hb.close()
        if not self._threads.started("dispatch"):  # run_once() called without start(): its connection
            self._dispatch_slot.close()
        self.log.info("pool_stopped", outcomes=dict(self.outcomes))

    def _wait_idle(self, timeout_s: float) -> bool:
        """Wait until no job waits or runs (successes may still wait for their completion)."""
        with self._lock:
            return self._lock.wait_for(lambda: self._line.total == 0, timeout=timeout_s)

    def _failed(self, exc: FatalError) -> None:
        """A person has to act (rejected credentials, a missing grant): every job would meet
        it, so the pool stops claiming (``error``); running jobs write their own outcomes."""
        with self._lock:
            first = self.error is None
            self.error = self.error or exc
        if first:
            self.log.error("pool_failed", error=str(exc), error_type=type(exc).__name__)
        self._stopping.set()
        self._wake.set()

    # -- state ----------------------------------------------------------------------------

    def busy_by_queue(self) -> dict[str, int]:
        with self._lock:
            return {q: n for q, n in self._line.running.items() if n > 0}

    def running(self) -> list[JobContext]:
        with self._lock:
            return list(self._running.values())

    def health(self) -> PoolHealth:
        """For a readiness probe (see :class:`~consumer_sdk.jobs.refusals.PoolHealth`)."""
        return self._refusals.health(error=self.error, started=self._started, stopping=self._stopping.is_set(),
                                     stuck=self._hb.stuck_handlers(), capacity=self.config.max_concurrency,
                                     database=self._outage.reason(), failed_rounds=self._outage.failed_rounds)

    def heartbeat_once(self) -> int:
        """Renew every running job's lease; cancel the attempts that lost it.  Returns how many."""
        return self._hb.once()

