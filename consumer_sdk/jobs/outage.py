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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from consumer_sdk.errors import DatabaseUnavailable
from consumer_sdk.jobs.errors import DatabaseReadOnly
from consumer_sdk.jobs.metrics import JobsMetrics
from outbox_core.secrets import mask_text

#: Not ready once an outage holds this many failed rounds...
NOT_READY_ROUNDS = 2
#: ... and began this many seconds ago (the start of its first failed round).
NOT_READY_S = 2.0
#: An outage's ``dispatch_failed`` is logged again at most this often (seconds) while it lasts.
LOG_EVERY_S = 30.0
_HINT = ("the dispatcher tries again with back-off (at most poll_interval_s) and claims nothing meanwhile; "
         f"logged again at most every {LOG_EVERY_S:.0f} s while it lasts, dispatch_recovered when a round passes")


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
    logged_at: float

    def reason(self) -> str:
        """What the pool's health says of it (without how long: see :meth:`Outage.reason`)."""
        if self.read_only:
            return "the database is read-only (a standby, or a failover in progress)"
        return "the database is unavailable (stopped, unreachable, or refusing connections)"


class Outage:
    """The dispatcher's failed rounds in a row.  Written by the dispatcher's thread only
    (:meth:`failed`, :meth:`passed`, :meth:`close`); read from any thread (an immutable
    snapshot): :meth:`reason` for ``health()``, the gauge when scraped."""

    def __init__(self, *, log: Any, metrics: JobsMetrics, clock: Callable[[], float],
                 not_ready_rounds: int = NOT_READY_ROUNDS, not_ready_s: float = NOT_READY_S,
                 log_every_s: float = LOG_EVERY_S) -> None:
        self.log = log
        self._clock = clock
        self.not_ready_rounds, self.not_ready_s, self.log_every_s = not_ready_rounds, not_ready_s, log_every_s
        self.streak: Streak | None = None
        metrics.database_unavailable.set_function(lambda: 1.0 if self.reason() is not None else 0.0)

    def failed(self, exc: Exception, *, began: float) -> None:
        """A round that began at ``began`` (the clock's seconds) failed with ``exc``: count it;
        log it when it is the outage's first, its error's type changed, or :data:`LOG_EVERY_S` passed."""
        now, last = self._clock(), self.streak
        error, error_type = mask_text(str(exc)), type(exc).__name__
        streak = Streak(began=began if last is None else last.began, rounds=1 if last is None else last.rounds + 1,
                        error=error, error_type=error_type, database=isinstance(exc, DatabaseUnavailable),
                        read_only=isinstance(exc, DatabaseReadOnly), logged_at=now if last is None else last.logged_at)
        due = last is None or last.error_type != error_type or now - last.logged_at >= self.log_every_s
        self.streak = replace(streak, logged_at=now) if due else streak
        if due:
            self.log.warning("dispatch_failed", error=error, error_type=error_type, rounds=streak.rounds,
                             failing_s=round(now - streak.began, 1), hint=_HINT)

    def passed(self, *, read_only_session: bool = False) -> None:
        """A round passed (or the database answered it with a refusal).  One that
        passed on a ``read_only_session`` only read: it ends nothing (see the module)."""
        streak = self.streak
        if streak is None or read_only_session:
            return
        self.streak = None
        self.log.info("dispatch_recovered", rounds=streak.rounds, failed_s=round(self._clock() - streak.began, 1),
                      error=streak.error, error_type=streak.error_type)

    def close(self) -> None:
        """The dispatcher stopped: nothing is failing any more (no line)."""
        self.streak = None

    @property
    def failed_rounds(self) -> int:
        """The rounds failed in a row for the database (0: none, or the last one passed)."""
        streak = self.streak
        return streak.rounds if streak is not None and streak.database else 0

    def reason(self, now: float | None = None) -> str | None:
        """Why the pool is not ready, while the outage is :data:`NOT_READY_ROUNDS` rounds and
        :data:`NOT_READY_S` old (``now``: the clock's seconds); else None."""
        streak = self.streak
        if streak is None or not streak.database or streak.rounds < self.not_ready_rounds:
            return None
        failing_s = (self._clock() if now is None else now) - streak.began
        if failing_s < self.not_ready_s:
            return None
        headline = streak.reason()
        return (f"{headline} for {failing_s:.0f} s ({streak.rounds} dispatch rounds failed in a row, nothing "
                f"claimed meanwhile): {streak.error.removeprefix(headline + ': ')}")  # DatabaseReadOnly's own words
