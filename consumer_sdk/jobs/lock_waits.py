"""What the worker pool's dispatcher and heartbeat wait on in the database, when they wait long.

An operator's ``LOCK TABLE jobs``, a migration waiting for its lock with the pool's
statements queued behind it, or a long transaction holding a job row holds the dispatcher's
claim or the heartbeat's lease renewal until it ends.  The pool then silently stopped
claiming and renewing: the leases ran out under running handlers (cancelled,
``lease_unconfirmed``), nothing was logged and no metric moved.

:class:`PoolLockWaitWatch` (an :class:`outbox_core.waits.SessionWatch`, like the relay's
and the inbox consumer's) looks only while the dispatcher's or the heartbeat's connection
has had a statement in flight for ``after_s`` (:meth:`ConnSlot.in_use
<consumer_sdk.jobs._conn.ConnSlot.in_use>`, sampled every ``every_s``: a round of short
statements back to back may pass for one long one, which costs one look and logs nothing,
as the server says how long each statement has run).  Then, on a connection of its own made
by the pool's factory (``<application_name>:watch``, with the pool's ``statement_timeout``:
:func:`~consumer_sdk.jobs._conn.watch_connect`; closed once both move again), it reads what those two sessions wait
on (``waits.sql`` ``relay_waits``: catalog views only).  A lock wait is logged as
``jobs_lock_wait`` (again every :data:`~outbox_core.waits.LOG_EVERY_S` per session and
blocker) naming the session (``dispatcher`` or ``heartbeat``), the blocking backend (pid,
application_name, state, query) and what to do; ``jobs_lock_wait_over`` when it ended.
Nothing is changed: the wait ends when the blocking transaction does.

The gauge ``outbox_jobs_lock_wait_seconds{queue}``, for each queue the pool serves, is the
longer of the two sessions' lock waits at the last look: 0 when none takes long, when the
look found no lock wait or could not look, and once the watch stops.  Behind a transaction
pooler a client's backend pid is not its server session's: nothing is found there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from consumer_sdk.jobs._conn import ConnSlot
from consumer_sdk.jobs.metrics import JobsMetrics
from outbox_core.queries import query
from outbox_core.waits import LOOK_AFTER_S, LOOK_EVERY_S, SessionWatch, Waiting, held_by

#: What each session does for the pool, as the log's ``detail`` says it.
_DOES = {"dispatcher": "the pool's dispatcher (its claims and reaps)",
         "heartbeat": "the pool's heartbeat (its lease renewals)"}
_END_IT = ("The blocking backend (blocking_pids; its application_name, state and query in detail) is "
           "most often an operator's LOCK TABLE or maintenance on the jobs tables, a migration waiting "
           "for its own lock with the pool queued behind it (run migrations with a lock_timeout), or a "
           "transaction left open on job rows: let it finish, or end it (pg_cancel_backend(pid); "
           "pg_terminate_backend(pid) for a session idle in transaction)")
_HINTS = {"dispatcher": "the pool claims no job and reaps no expired lease until the blocking transaction "
                        "ends: ready jobs wait. " + _END_IT,
          "heartbeat": "the pool renews no lease until the blocking transaction ends: each running handler is "
                       "cancelled (lease_unconfirmed) when its lease runs out (lease_duration_s), and its job "
                       "is run again. " + _END_IT}


@dataclass(frozen=True, slots=True)
class PoolSession:
    """One of the pool's sessions the watch looks at.

    ``role``: ``dispatcher`` or ``heartbeat``; ``session``: its ``(backend pid,
    application_name)``, None while it has no connection; ``busy_since``: when (the watch's
    clock, monotonic seconds) its statement in flight began, None while none is."""

    role: str
    session: Callable[[], tuple[int, str] | None]
    busy_since: Callable[[], float | None]


class InUseSince:
    """A ``busy_since`` from ``in_use()`` (a slot's statement in flight now), sampled at each
    call: when it was first seen in use at every call since, None when it is not."""

    def __init__(self, in_use: Callable[[], bool], clock: Callable[[], float] = time.monotonic) -> None:
        self._in_use, self._clock = in_use, clock
        self._since: float | None = None

    def __call__(self) -> float | None:
        if not self._in_use():
            self._since = None
        elif self._since is None:
            self._since = self._clock()
        return self._since


def slot_session(role: str, slot: ConnSlot, clock: Callable[[], float] = time.monotonic) -> PoolSession:
    """The session of a pool thread's :class:`ConnSlot` (its accessors, read from the watch)."""
    return PoolSession(role=role, session=lambda: slot.session, busy_since=InUseSince(slot.in_use, clock))


class PoolLockWaitWatch(SessionWatch[tuple[str, int]]):
    """The watching thread; see the module's docstring.  ``start()``, idempotent ``stop()``,
    ``run_once()`` (one look when a session's statement takes long; tests call it).

    ``connect``: the pool's connection factory; ``sessions``: what it looks at
    (:meth:`of_slots` builds them from the dispatcher's and the heartbeat's slots);
    ``queues``: the pool's, each of which gets the gauge."""

    lock_wait_event = "jobs_lock_wait"
    over_event = "jobs_lock_wait_over"
    thread_name = "jobs-lock-waits"

    def __init__(self, connect: Callable[[], Any], *, sessions: Sequence[PoolSession], metrics: JobsMetrics,
                 queues: Sequence[str], log: Any, after_s: float = LOOK_AFTER_S, every_s: float = LOOK_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        gauges = [metrics.lock_wait.labels(queue) for queue in queues]  # 0 until a wait: the series exist
        #: The longest lock wait the last look found (seconds; 0: none), as the gauge shows it
        #: (read by the pool's outage bookkeeping: a lock wait is no outage).
        self.last_wait_s = 0.0

        def report(seconds: float) -> None:
            self.last_wait_s = seconds
            for gauge in gauges:
                gauge.set(seconds)

        super().__init__(connect, statement=query("waits", "relay_waits"), log=log, report=report,
                         after_s=after_s, every_s=every_s, clock=clock)
        self._sessions = tuple(sessions)
        self._roles: dict[int, str] = {}  # backend pid -> role, as of the last look

    @classmethod
    def of_slots(cls, connect: Callable[[], Any], *, dispatcher: ConnSlot, heartbeat: ConnSlot,
                 metrics: JobsMetrics, queues: Sequence[str], log: Any,
                 clock: Callable[[], float] = time.monotonic, **timing: float) -> PoolLockWaitWatch:
        """The watch of a pool whose dispatcher and heartbeat use these slots."""
        return cls(connect, sessions=[slot_session("dispatcher", dispatcher, clock),
                                      slot_session("heartbeat", heartbeat, clock)],
                   metrics=metrics, queues=queues, log=log, clock=clock, **timing)

    def held_up_s(self) -> float:
        now, longest = self._clock(), 0.0
        for pool_session in self._sessions:
            since = pool_session.busy_since()  # sampled at every tick, whatever the others say
            if since is not None and pool_session.session() is not None:
                longest = max(longest, now - since)
        return longest

    def _look(self) -> tuple[Waiting, ...]:
        found = {s.role: s.session() for s in self._sessions}
        sessions = {role: session for role, session in found.items() if session is not None}
        self._roles = {pid: role for role, (pid, _name) in sessions.items()}
        if not sessions:
            return ()
        names = {name for _pid, name in sessions.values()}
        return tuple(w for w in self._read(names) if w.pid in self._roles and w.on_lock)

    def _role(self, wait: Waiting) -> str:
        return self._roles.get(wait.pid, "dispatcher")

    def _key(self, wait: Waiting) -> tuple[str, int]:
        return (self._role(wait), min((b.pid for b in wait.blockers), default=0))

    def _lock_wait_fields(self, wait: Waiting) -> dict[str, Any]:
        role = self._role(wait)
        held = held_by(wait.blockers)
        does = _DOES.get(role, "the pool's " + role)
        detail = (f"{does} has waited {wait.running_s:.0f} s on a lock "
                  f"({wait.relation or wait.wait_event or 'a lock'}, {wait.mode})" + (f", held by {held}" if held else ""))
        return {"session": role, "pid": wait.pid, "lock": wait.wait_event, "relation": wait.relation,
                "mode": wait.mode, "waited_s": round(wait.running_s, 1),
                "blocking_pids": [b.pid for b in wait.blockers],
                "blockers": [b.application_name for b in wait.blockers], "detail": detail,
                "hint": _HINTS.get(role, _END_IT)}

    def _over_fields(self, keys: list[tuple[str, int]]) -> dict[str, Any]:
        return {"sessions": sorted({role for role, _ in keys}), "blocking_pids": sorted({pid for _, pid in keys})}
