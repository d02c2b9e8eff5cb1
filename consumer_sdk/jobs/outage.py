"""The dispatcher's rounds that fail in a row because the database is unavailable or read-only.

PostgreSQL stopped, the network cut, a standby or a failover in progress (``DatabaseReadOnly``,
a :class:`~consumer_sdk.errors.DatabaseUnavailable`): every round of the dispatcher fails
until the database is back.  Each round logged ``dispatch_failed`` and went on, and
:meth:`~consumer_sdk.jobs.worker.WorkerPool.health` said ``ready`` all along: a readiness
probe kept routing work to a pool that could claim nothing, and the log got a line per
round (an audit of the pool).  Now such a run of failed rounds (an outage, :class:`Outage`):

* is logged once: ``dispatch_failed`` (a warning, the error's words) at its first round,
  again when the error's type changes (unreachable, then read-only), else at most every
  :data:`LOG_EVERY_S` with the rounds failed so far; ``dispatch_recovered`` once, when a round
  passes, with how long it lasted and how many rounds failed;
* makes the pool not ready once it is :data:`NOT_READY_ROUNDS` rounds and
  :data:`NOT_READY_S` seconds old, with a reason a person can act on; ready again as soon
  as a round passes.  One failed round is a blip (a connection the server or a pooler
  ended: the next round, 0.1 s later, opens a new one and passes); two in a row mean the
  new connection failed too, and two seconds of that is an outage, not a blip (a probe
  checks every few seconds: a signal within them, no flapping on a single failure);
* is the gauge ``outbox_jobs_database_unavailable`` (1 while the pool is not ready for it,
  read when scraped).

A round that passed on a read-only session (PostgreSQL 14 and later report it, no round trip)
ends nothing: it only read (nothing to claim), and the pool's next write fails again (its
reap, every quarter lease).  Ended by such rounds, an outage on a standby with an empty
queue was over and back at every reap (a ``dispatch_recovered`` and a ``dispatch_failed``
each time).  A round the database refused (:mod:`.refusals`) ends it: the database answers,
and the refusal says why the pool is not ready.  A fatal error (rejected credentials) stops
the dispatcher, which ends it without a line (:meth:`Outage.close`): ``pool_failed`` says why.

The lease heartbeat's failures are not counted here: it runs only while jobs run, so once its
attempts are given up no heartbeat would pass to end an outage; the dispatcher's rounds run
every ``poll_interval_s`` whatever the pool holds, on the same database.

A round that does not fail but hangs (:meth:`Outage.in_flight`): in a partition that drops
packets (no RST) a statement waits until TCP gives up (``tcp_user_timeout``: one lease by
default, often minutes in production, never behind a proxy that keeps acknowledging), and the
pool said ready and logged nothing meanwhile.  Now a round in flight for :data:`UNANSWERED_S`
is an outage too: the pool is not ready ("the database has not answered the dispatcher for
N s ..."), the gauge is 1, ``dispatch_unanswered`` is logged once (by a watching thread: the
dispatcher's own is stuck in the statement), again every :data:`LOG_EVERY_S`, and
``dispatch_recovered`` (``unanswered_s``) when the round returns; ready again then.  When it
fails instead (TCP gave up), its failed round keeps the pool not ready (it needs no second
one), and a round in flight for :data:`NOT_READY_S` after a failed one counts as failed.
Why ten seconds: a round's statements take milliseconds (a claim of at most
``max_concurrency`` rows through an index, bounded reaps), a slow one on a big table a second
or two; it is well within a lease (30 s by default), so before ``tcp_user_timeout`` ends the
statement, and within a readiness probe's default failure window (3 x 10 s); and by then the
pool's lock-wait watch (:mod:`.lock_waits`: it looks once a statement is 5 s old, every 2 s)
has looked at least once.

A lock wait is not an outage: while that watch finds the dispatcher's or the heartbeat's
statement waiting on a lock (its last look found one: ``PoolLockWaitWatch.last_wait_s``, what
``outbox_jobs_lock_wait_seconds`` shows), the database answers, and a round in flight that long keeps the pool ready.  Such a
lock (an operator's ``LOCK TABLE``, a migration) holds every pool of every service alike:
not ready, each of them would be taken out of rotation (with the service that embeds it) for
no gain, and the wait ends when a person ends the blocking transaction, which
``jobs_lock_wait`` and the alert ``OutboxJobsLockWait`` name.  A statement that merely runs
that long is not told apart from a server that does not answer: the reason says both.

A round whose statement the server cancelled for the pool's ``statement_timeout``
(``pool_statement_timeout_s``, :class:`~consumer_sdk.jobs.errors.StatementTimedOut`) is a failed round
like the others (the database answers, too slowly to claim): ``dispatch_failed`` names the
round's step (``statement``: the claim, the schema check, ...) and the setting; the next
round tries again.  Not the upkeep's: a reconcile's or a reap's statement cancelled so is
skipped and named (``reconcile_timed_out``, :mod:`consumer_sdk.jobs.reconciler`) and the round
claims.  When the lock-wait watch found that statement waiting on a lock, the line
says so and the round does not count towards an outage: a lock wait keeps the pool ready
whether the statement still waits or its timeout cancelled it (until a review, a lock held
longer than the timeout made the pool not ready at its second cancelled round).  Under an
``lc_messages`` whose words do not say "statement timeout", the cancel is told by its
SQLSTATE (57014) for this.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from consumer_sdk.errors import DatabaseUnavailable
from consumer_sdk.jobs.errors import DatabaseReadOnly, StatementTimedOut
from consumer_sdk.jobs.metrics import JobsMetrics
from outbox_core.secrets import mask_text
from outbox_core.streaks import FailureStreak

#: Not ready once an outage holds this many failed rounds...
NOT_READY_ROUNDS = 2
#: ... and began this many seconds ago (the start of its first failed round).
NOT_READY_S = 2.0
#: An outage's ``dispatch_failed`` is logged again at most this often (seconds) while it lasts.
LOG_EVERY_S = 30.0
#: A dispatch round in flight this long (seconds) has not been answered (see the module).
UNANSWERED_S = 10.0
#: How often the watching thread looks at the round in flight (seconds).
WATCH_EVERY_S = 1.0
_UNANSWERED_HINT = ("a network partition that drops packets, or a server that does not answer (a statement "
                    "that runs that long reads the same; a lock wait is named by jobs_lock_wait instead): the "
                    "statement fails once TCP gives up (tcp_user_timeout, lease_duration_s unless the DSN sets "
                    "it) and the pool connects again; dispatch_recovered when it returns")
_HINT = ("the dispatcher tries again with back-off (at most poll_interval_s) and claims nothing meanwhile; "
         f"logged again at most every {LOG_EVERY_S:.0f} s while it lasts, dispatch_recovered when a round passes")
_TIMED_OUT_HINT = ("the database answers, too slowly: look for what slows it (CPU or I/O saturation, a large scan "
                   "of the jobs tables: pg_stat_activity, pg_stat_statements); raise pool_statement_timeout_s "
                   "(0: none) only if such a statement is expected to take that long. ")
_LOCKED_HINT = "It waited on a lock (jobs_lock_wait names the blocking backend). "


@dataclass(frozen=True, slots=True)
class Streak:
    """The rounds failed in a row: since ``began`` (monotonic seconds, the start of the first
    one), ``rounds`` of them, the last with ``error`` (masked) of type ``error_type``;
    ``database``: the last failed for the database (unavailable, read-only)."""

    began: float
    rounds: int
    error: str
    error_type: str
    database: bool
    read_only: bool
    #: A round of it went unanswered for UNANSWERED_S before it failed: no second round is needed.
    unanswered: bool = False

    def reason(self) -> str:
        """What the pool's health says of it (without how long: see :meth:`Outage.reason`)."""
        if self.error_type == StatementTimedOut.__name__:
            return "the database cancelled the dispatcher's statements for their statement_timeout"
        if self.read_only:
            return "the database is read-only (a standby, or a failover in progress)"
        return "the database is unavailable (stopped, unreachable, or refusing connections)"


class Outage:
    """The dispatcher's failed rounds in a row, and its round in flight.  Written by the
    dispatcher's thread only (:meth:`in_flight`, :meth:`failed`, :meth:`passed`, :meth:`close`);
    read from any thread (immutable snapshots): :meth:`reason` for ``health()``, the gauge when
    scraped, :meth:`check` (the watching thread, started by the first :meth:`in_flight`).
    ``queues``: the pool's, whose lock-wait gauge says the database answers (see the module);
    ``wall``: the time of day, for the reason's "since"."""

    def __init__(self, *, log: Any, metrics: JobsMetrics, clock: Callable[[], float],
                 not_ready_rounds: int = NOT_READY_ROUNDS, not_ready_s: float = NOT_READY_S,
                 log_every_s: float = LOG_EVERY_S, unanswered_s: float = UNANSWERED_S,
                 lock_wait_s: Callable[[], float] = lambda: 0.0, wall: Callable[[], float] = time.time,
                 watch_every_s: float = WATCH_EVERY_S) -> None:
        """``lock_wait_s``: the pool's lock-wait watch's last finding (seconds, 0: none)."""
        self.log = log
        self._clock, self._wall = clock, wall
        self.not_ready_rounds, self.not_ready_s = not_ready_rounds, not_ready_s
        self.unanswered_s, self.watch_every_s = unanswered_s, watch_every_s
        self.streak: Streak | None = None
        self.lock_wait_s = lock_wait_s
        self._flight: tuple[float, float] | None = None  # the round in flight: (clock, wall) at its start
        self._failures = FailureStreak(every_s=log_every_s)  # the rounds in self.streak: when to say so
        self._unanswered = FailureStreak(every_s=log_every_s)  # the watch's looks at the round in flight
        self._note_lock = threading.Lock()  # the watch's line against the round's end
        self._unanswered_ended: float | None = None  # the round that just ended went unanswered this long
        self._closed = threading.Event()
        self._watch: threading.Thread | None = None
        metrics.database_unavailable.set_function(lambda: 1.0 if self.reason() is not None else 0.0)

    @contextmanager
    def in_flight(self, began: float) -> Iterator[None]:
        """Around a dispatch round that began at ``began`` (the clock's seconds); the dispatcher's
        :meth:`passed` or :meth:`failed` follows it."""
        if self._watch is None:
            self._closed.clear()
            self._watch = threading.Thread(target=self._run_watch, name="jobs-dispatch-watch", daemon=True)
            self._watch.start()
        self._flight = (began, self._wall())
        try:
            yield
        finally:
            with self._note_lock:
                self._flight = None
                looks, unanswered_s = self._unanswered.passed(self._clock())
            self._unanswered_ended = unanswered_s if looks else None

    def _run_watch(self) -> None:
        while not self._closed.wait(self.watch_every_s):
            self.check()

    def check(self) -> None:
        """The watching thread (tests call it): log ``dispatch_unanswered`` for a round in flight
        for :data:`UNANSWERED_S` (not a lock wait), once, then every :data:`LOG_EVERY_S`."""
        with self._note_lock:
            flight, now = self._flight, self._clock()
            if flight is None or self._unanswered_for(flight, now) < self.unanswered_s:
                return
            if not self._unanswered.failed(now, began=flight[0]):
                return
        self.log.warning("dispatch_unanswered", unanswered_s=round(now - flight[0], 1), since=_utc(flight[1]),
                         detail=self._unanswered_reason(now - flight[0], flight[1]), hint=_UNANSWERED_HINT)

    def _unanswered_for(self, flight: tuple[float, float] | None, now: float) -> float:
        """How long the round in flight has gone unanswered: 0 without one, or while the pool's
        lock-wait watch finds a lock wait (the database answers)."""
        if flight is None or now - flight[0] < self.not_ready_s or self.lock_wait_s() > 0:
            return 0.0
        return now - flight[0]

    def _unanswered_reason(self, unanswered_s: float, since: float) -> str:
        return (f"the database has not answered the dispatcher for {unanswered_s:.0f} s (a round in flight since "
                f"{_utc(since)}, nothing claimed meanwhile): a network partition, or a server that does not "
                "answer (or a statement that runs that long)")

    def failed(self, exc: Exception, *, began: float, statement: str | None = None) -> None:
        """A round that began at ``began`` (the clock's seconds) failed with ``exc`` in ``statement``
        (what the round was doing); count it; log it when it is the outage's first, its error's type
        changed, or :data:`LOG_EVERY_S` passed."""
        now, last = self._clock(), self.streak
        error, error_type = mask_text(str(exc)), type(exc).__name__
        unanswered = self._unanswered_ended is not None or (last is not None and last.unanswered)
        self._unanswered_ended = None
        locked = _cancelled(exc) and self.lock_wait_s() > 0  # a lock wait, not an outage
        due = self._failures.failed(now, kind=error_type, began=began)
        self.streak = streak = Streak(
            began=self._failures.began, rounds=self._failures.failures, error=error, error_type=error_type,
            database=isinstance(exc, DatabaseUnavailable) and not locked, read_only=isinstance(exc, DatabaseReadOnly),
            unanswered=unanswered)
        if due:
            said = {} if statement is None else {"statement": statement}
            hint = _HINT
            if isinstance(exc, StatementTimedOut):
                hint = (_LOCKED_HINT if locked else "") + _TIMED_OUT_HINT + _HINT
            self.log.warning("dispatch_failed", error=error, error_type=error_type, rounds=streak.rounds,
                             failing_s=round(now - streak.began, 1), hint=hint, **said)

    def passed(self, *, read_only_session: bool = False) -> None:
        """A round passed (or the database answered it with a refusal).  One that
        passed on a ``read_only_session`` only read: it ends nothing (see the module)."""
        streak, unanswered_s, self._unanswered_ended = self.streak, self._unanswered_ended, None
        said = {} if unanswered_s is None else {"unanswered_s": round(unanswered_s, 1)}
        if streak is not None and not read_only_session:
            rounds, failed_s = self._failures.passed(self._clock())
            self.streak = None
            self.log.info("dispatch_recovered", rounds=rounds, failed_s=round(failed_s, 1),
                          error=streak.error, error_type=streak.error_type, **said)
        elif unanswered_s is not None:  # a round that hung, then returned: the database answers again
            self.log.info("dispatch_recovered", rounds=0, failed_s=said["unanswered_s"],
                          error="no answer from the database", error_type="Unanswered", **said)

    def close(self) -> None:
        """The dispatcher stopped: nothing is failing any more (no line); the watch ends."""
        self.streak, self._flight = None, None
        self._failures.passed(self._clock())  # ended without a line
        self._closed.set()
        self._watch = None

    @property
    def failed_rounds(self) -> int:
        """The rounds failed in a row for the database (0: none, or the last one passed)."""
        streak = self.streak
        return streak.rounds if streak is not None and streak.database else 0

    def reason(self, now: float | None = None) -> str | None:
        """Why the pool is not ready, while the round in flight has gone unanswered for
        :data:`UNANSWERED_S`, or the outage is :data:`NOT_READY_ROUNDS` rounds (one that went
        unanswered first; the round in flight after :data:`NOT_READY_S`, counted) and
        :data:`NOT_READY_S` old (``now``: the clock's seconds); else None."""
        now = self._clock() if now is None else now
        flight, streak = self._flight, self.streak
        unanswered_s = self._unanswered_for(flight, now)
        if flight is not None and unanswered_s >= self.unanswered_s:
            return self._unanswered_reason(unanswered_s, flight[1])
        if streak is None or not streak.database:
            return None
        rounds = streak.rounds + (1 if unanswered_s >= self.not_ready_s else 0)
        failing_s = now - streak.began
        if (rounds < self.not_ready_rounds and not streak.unanswered) or failing_s < self.not_ready_s:
            return None
        headline = streak.reason()
        return (f"{headline} for {failing_s:.0f} s ({streak.rounds} dispatch rounds failed in a row, nothing "
                f"claimed meanwhile): {streak.error.removeprefix(headline + ': ')}")  # DatabaseReadOnly's own words


def _cancelled(exc: BaseException) -> bool:
    """``exc`` is a statement the server cancelled: :class:`StatementTimedOut`, or, under an
    ``lc_messages`` whose words ``_db`` does not read, a cause with SQLSTATE 57014 (a
    statement_timeout's, or a cancel request's: either way the statement ran or waited that
    long, not a database away)."""
    return isinstance(exc, StatementTimedOut) or getattr(exc.__cause__, "sqlstate", None) == "57014"


def _utc(wall: float) -> str:
    """A time of day for people: ``2026-12-07 01:23:45 UTC``."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(wall))
