"""Wake-ups: LISTEN/NOTIFY, and relayed Kafka events through the dedup consumer.

Wake-ups only speed discovery; the pool's poll (``poll_interval_s``) is the
safety net, so losing every one of them delays work by at most one poll.

* :class:`Listener`: a thread that LISTENs on ``outbox_jobs`` (the jobs table's
  triggers notify with the queue name on insert and when a job becomes
  ``queued`` again) and calls ``on_wake(queue)``; it reconnects with back-off
  and wakes once after every (re)connect, for what it may have missed.  Its failures in a
  row are logged once (:class:`ListenFailures`: ``listen_failed`` at the first, with the
  error, again every :data:`LOG_EVERY_S` with the count, ``listen_recovered`` when it listens
  again): it logged ``listen_failed`` at every attempt, about every 5 s for as long as the
  database was down, next to the dispatcher's single line (an audit of the pool).  Not through a
  transaction pooler (PgBouncer's ``pool_mode = transaction``, found by the pool's
  connection factory): LISTEN stays on a server session the pooler lends to others, and no
  notification ever came back, while ``pool.listening`` said True (an audit of the pool).
  There it logs ``listen_unavailable`` once and ends: the pool claims at its poll and on
  :meth:`~consumer_sdk.jobs.worker.WorkerPool.wake` (relayed events: :func:`wake_handler`).
* :func:`wake_handler`: a handler for :class:`~consumer_sdk.inbox.InboxConsumer`
  that wakes a pool for each event about a job (the ``jobs_queue`` header that
  :mod:`consumer_sdk.jobs.events` writes), e.g. ``run.accepted`` events relayed
  from another service's database.
* :func:`activation_handler`: a handler that turns events into activations, in
  the consumer's transaction: the activation is recorded exactly once, together
  with the event's inbox row.

A handler must never wake a pool for a change its own transaction makes: the
pool would look before the commit.  Wake for what is already committed (events
relayed from the outbox are, by construction).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import psycopg
import structlog

from consumer_sdk.errors import FatalError, OutboxSdkError
from consumer_sdk.jobs._conn import ConnectionFactory
from consumer_sdk.jobs._db import ConnectionT, first_line, q
from consumer_sdk.jobs.model import QUEUE_HEADER
from consumer_sdk.jobs.waits import activate
from consumer_sdk.model import InboxMessage
from outbox_core.secrets import mask_text
from outbox_core.streaks import FailureStreak

CHANNEL = "outbox_jobs"
_NOTIFY_TIMEOUT_S = 0.5
_MAX_PAUSE_S = 5.0
#: Failures to listen that go on are logged again at most this often (seconds), with their count.
LOG_EVERY_S = 30.0
_HINT = ("the listener tries again with back-off (at most 5 s); meanwhile new jobs are claimed at the pool's "
         f"poll (poll_interval_s); logged again at most every {LOG_EVERY_S:.0f} s while it lasts, "
         "listen_recovered when it listens again")

#: The inbox consumer's handler type (kept local: the jobs package does not import the consumer).
InboxHandler = Callable[[ConnectionT, InboxMessage], None]


class Wakeable(Protocol):
    def wake(self, queue: str | None = None) -> None: ...


class ListenFailures:
    """The listener's failures in a row (a streak), and what is logged of them: the first with
    its error (masked), then at most every :data:`LOG_EVERY_S` with the count so far; the end
    once.  Used by the listening thread only; ``now``: monotonic seconds."""

    def __init__(self, log: Any, *, log_every_s: float = LOG_EVERY_S) -> None:
        self.log, self.streak = log, FailureStreak(every_s=log_every_s)

    def failed(self, exc: BaseException, now: float) -> None:
        if self.streak.failed(now):
            self.log.warning("listen_failed", error=mask_text(first_line(exc)), error_type=type(exc).__name__,
                             failures=self.streak.failures, failing_s=round(now - self.streak.began, 1), hint=_HINT)

    def listening(self, now: float) -> None:
        failures, failed_s = self.streak.passed(now)
        if failures:
            self.log.info("listen_recovered", failures=failures, failed_s=round(failed_s, 1))


class Listener:
    """LISTEN on its own connection; ``on_wake(queue)`` for each notification.  start/stop."""

    def __init__(self, connect: ConnectionFactory, on_wake: Callable[[str | None], None], *,
                 log: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._connect = connect
        self._on_wake = on_wake
        self._clock = clock
        self.log = log if log is not None else structlog.get_logger("consumer_sdk.jobs.wake")
        self.failures = ListenFailures(self.log)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.connected = threading.Event()
        self.notifications = 0

    @property
    def thread(self) -> threading.Thread | None:
        """The listening thread, once started."""
        return self._thread

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="jobs-listen", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Idempotent; returns within about half a second."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        pause_s = 0.1
        while not self._stop.is_set():
            try:
                with self._connect() as conn:
                    if getattr(self._connect, "pooled", False):  # probed by the factory's first connection
                        self._unavailable()
                        return
                    conn.autocommit = True
                    conn.execute(q("listen"))
                    self.connected.set()
                    self.failures.listening(self._clock())
                    pause_s = 0.1
                    self._on_wake(None)  # anything sent while we were not listening
                    self._drain(conn)
            except FatalError as exc:  # e.g. rejected credentials: waiting will not help
                self.connected.clear()
                self.log.error("listen_stopped", error=mask_text(str(exc)), error_type=type(exc).__name__)
                return
            except (psycopg.Error, OutboxSdkError) as exc:
                self.connected.clear()
                self.failures.failed(exc, self._clock())  # once a streak, not at every attempt
                self._stop.wait(pause_s)
                pause_s = min(pause_s * 2, _MAX_PAUSE_S)

    def _unavailable(self) -> None:
        self.log.warning("listen_unavailable", detail="the pool's connections go through a transaction "
                         "pooler, where no notification ever comes back: not listening",
                         hint="new jobs are claimed at the pool's poll (poll_interval_s) or on pool.wake(); "
                              "wake it from relayed events (wake_handler), or listen=False to say so")

    def _drain(self, conn: ConnectionT) -> None:
        while not self._stop.is_set():
            for notify in conn.notifies(timeout=_NOTIFY_TIMEOUT_S):
                self.notifications += 1
                self._on_wake(notify.payload or None)


def wake_handler(pool: Wakeable, *, then: InboxHandler | None = None) -> InboxHandler:
    """An inbox handler that wakes ``pool`` for events about jobs (and then calls ``then``)."""

    def handle(conn: ConnectionT, message: InboxMessage) -> None:
        if then is not None:
            then(conn, message)
        queue = message.header(QUEUE_HEADER)
        if queue is not None:
            pool.wake(queue)

    return handle


def activation_handler(key_of: Callable[[InboxMessage], str | None], *,
                       payload_of: Callable[[InboxMessage], Any] = lambda m: m.json(),
                       events_topic: str | None = None) -> InboxHandler:
    """An inbox handler that records an activation for each event ``key_of`` names.

    Runs in the consumer's transaction: the activation and the inbox row commit
    together, so a redelivered event never activates twice (and a duplicated
    activation would change nothing anyway).  Events for which ``key_of`` returns
    None are ignored.  Waking a pool here would be too early (nothing is committed
    yet): workers learn of the resumed job from NOTIFY at the commit, from the
    ``job.resumed`` event written to ``events_topic`` once it is relayed, or from
    their poll.
    """

    def handle(conn: ConnectionT, message: InboxMessage) -> None:
        key = key_of(message)
        if key is not None:
            activate(conn, key, payload_of(message), events_topic=events_topic)

    return handle
