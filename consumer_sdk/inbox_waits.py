"""What the consumer's own transaction waits on in the database, when a batch takes long.

A handler hung past ``max.poll.interval.ms`` (past its keeper's limit, :mod:`.inbox_keeper`:
three intervals, then one more) leaves the group with its transaction open and
the inbox rows it claimed locked.  The partition's next owner claims the same events and
waits on those row locks: no timeout, no error, nothing logged, while its own membership
runs out in turn (an audit: the partition stalled as long as the hung handler).  A DBA's
lock, or another service's transaction holding a row the handler updates, stalls it the
same way.

:class:`LockWaitWatch` is a thread that looks only while a batch has been in the works for
``after_s``: then, on a connection of its own (made by the consumer's factory, closed once
the batch is done), it reads what the consumer's session waits on (``waits.sql``
``relay_waits``: ``pg_stat_activity``, ``pg_locks``, ``pg_blocking_pids``; only catalog
views, nothing that could wait on the inbox).  A lock wait is logged as
``database_lock_wait`` (again every :data:`LOG_EVERY_S`), naming the backend that holds it
up: its pid, application_name (another member of the group reads
``outbox-consumer:<name>``), state and query; ``database_wait_over`` when it ended.
Nothing is changed: the wait ends when the blocking transaction does.

The gauge ``outbox_consumer_lock_wait_seconds{consumer}`` (``wait_gauge``) says how long the
longest lock wait the last look saw has lasted: 0 when no batch takes long, when the look
found no lock wait or could not look, and once the watch stops.  A log line is written once
every :data:`LOG_EVERY_S`; the gauge follows every look, so an alert can hold on it.  The
thread, the look and its log lines are :class:`outbox_core.waits.SessionWatch`, shared with
the relay's watch and the jobs pool's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from outbox_core.queries import query
from outbox_core.waits import LOG_EVERY_S as LOG_EVERY_S
from outbox_core.waits import LOOK_AFTER_S, LOOK_EVERY_S, SessionWatch, Waiting, held_by
from outbox_core.waits import QUERY_CHARS as QUERY_CHARS

_HINT = ("the consumer's transaction waits until the blocking one ends; another member of this "
         "consumer's group holding it is most likely a member that left the group with its transaction "
         "open (a handler hung for 4 x max.poll.interval.ms): end its handler, or that backend "
         "(pg_terminate_backend(pid)); the event is then applied once")


class LockWaitWatch(SessionWatch[int]):
    """The watching thread; see the module's docstring.  ``start()``, idempotent ``stop()``,
    ``run_once()`` (one look when a batch takes long; tests call it).

    ``session``: the consumer's own session as ``(backend pid, application_name)``, None
    while it has none; ``busy_s``: how long the current batch has been in the works (0:
    none is); ``wait_gauge``: the gauge (``.set(seconds)``) the looks report to."""

    thread_name = "outbox-consumer-waits"

    def __init__(self, connect: Callable[[], Any], *, session: Callable[[], tuple[int, str] | None],
                 busy_s: Callable[[], float], log: Any, after_s: float = LOOK_AFTER_S,
                 every_s: float = LOOK_EVERY_S, clock: Callable[[], float] = time.monotonic,
                 wait_gauge: Any = None) -> None:
        super().__init__(connect, statement=query("waits", "relay_waits"), log=log,
                         report=None if wait_gauge is None else wait_gauge.set,
                         after_s=after_s, every_s=every_s, clock=clock)
        self._session, self._busy_s = session, busy_s

    def run_once(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """One look, when a batch has taken ``after_s``: the lock waits of the consumer's
        session found (logged as the module says)."""
        return [_as_dict(wait) for wait in super().run_once()]

    def held_up_s(self) -> float:
        return 0.0 if self._session() is None else self._busy_s()

    def _look(self) -> tuple[Waiting, ...]:
        session = self._session()
        if session is None:
            return ()
        pid, application_name = session
        return tuple(w for w in self._read([application_name]) if w.pid == pid and w.on_lock)

    def _key(self, wait: Waiting) -> int:
        return min((b.pid for b in wait.blockers), default=0)

    def _lock_wait_fields(self, wait: Waiting) -> dict[str, Any]:
        return {"pid": wait.pid, "lock": wait.wait_event, "mode": wait.mode, "relation": wait.relation,
                "waited_s": round(wait.running_s, 1), "blocking_pids": [b.pid for b in wait.blockers],
                "blockers": [b.application_name for b in wait.blockers], "detail": _describe(wait),
                "hint": _HINT}

    def _over_fields(self, keys: list[int]) -> dict[str, Any]:
        return {"blocking_pids": sorted(keys)}


def _as_dict(wait: Waiting) -> dict[str, Any]:
    """A lock wait as :meth:`LockWaitWatch.run_once` returns it."""
    return {"pid": wait.pid, "waited_s": round(wait.running_s, 1), "lock": wait.wait_event,
            "relation": wait.relation, "mode": wait.mode,
            "blockers": [{"pid": b.pid, "application_name": b.application_name, "state": b.state,
                          "query": b.query} for b in wait.blockers]}


def _describe(wait: Waiting) -> str:
    """One line for people: what waits, on what, for how long, behind whom."""
    on = wait.relation or wait.wait_event or "a lock"
    held = held_by(wait.blockers)
    return (f"the consumer's statement has waited {round(wait.running_s, 1):.0f} s on a lock ({on}, {wait.mode})"
            + (f", held by {held}" if held else ""))
