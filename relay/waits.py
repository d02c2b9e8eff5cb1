"""What the relay's own statements wait on in the database, when they wait long.

A DBA's ``LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE`` (or a ``VACUUM FULL``, an
``ALTER TABLE``) holds every statement of the relay on the outbox until it ends.  The relay
said nothing but ``heartbeat_late``; its loop, blocked in a claim, stopped ticking, so
/healthz failed after 30 s and the liveness probe restarted the sidecar: no help (the lock
is not the relay's business) and its in-flight state lost.

:class:`WaitWatch` is a thread that looks only while the relay seems held up (``held_up_s``:
its loop has not ticked, or rows in flight were not marked, for ``after_s``).  Then, on a
connection of its own (``outbox-relay:<owner>:watch``, opened for the look and closed once
the relay moves again), it reads the relay's own sessions whose statement has run for
``after_s`` or more (``waits.sql``: ``pg_stat_activity``, ``pg_locks``,
``pg_blocking_pids``): what each waits on and who holds it up.  A lock wait is logged
(``database_lock_wait``, again every :data:`LOG_EVERY_S`, ``database_wait_over`` when it
ends) and shown in ``outbox_relay_lock_wait_seconds``; any statement the server says is
running or waiting is :meth:`WaitWatch.current`, which /healthz takes as "alive, waiting on
the database" (relay/app.py).  Nothing found (a wedged relay, a connection the server no
longer has) changes nothing: liveness fails as before.  The thread, the look and its log
lines are :class:`outbox_core.waits.SessionWatch`, shared with the SDK's watches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from outbox_core.waits import LOG_EVERY_S as LOG_EVERY_S
from outbox_core.waits import LOOK_AFTER_S, LOOK_EVERY_S, SessionWatch
from outbox_core.waits import QUERY_CHARS as QUERY_CHARS
from outbox_core.waits import Blocker as Blocker
from outbox_core.waits import Waiting as Waiting
from outbox_core.waits import waiting_from_row as waiting_from_row
from relay.db import connect, translated
from relay.errors import RelayError
from relay.queries import query


class WaitWatch(SessionWatch[tuple[str, str | None]]):
    """The watching thread; see the module's docstring.  ``start()``, idempotent ``stop()``,
    ``run_once()`` (one look when held up; tests call it)."""

    thread_name = "outbox-relay-waits"

    def __init__(self, dsn: str, *, application_name: str, names: Iterable[str],
                 held_up_s: Callable[[], float], on_lock_wait_s: Callable[[float], None],
                 log: Any, after_s: float = LOOK_AFTER_S, every_s: float = LOOK_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``names``: the application_names of the relay's connections; ``held_up_s``: how
        long the relay has been held up (0: moving); ``on_lock_wait_s``: the longest lock
        wait seen (the gauge)."""
        own_name = application_name[:63]
        super().__init__(lambda: connect(dsn, application_name=own_name, connect_timeout_s=3),
                         statement=query("waits", "relay_waits"), log=log, report=on_lock_wait_s,
                         after_s=after_s, every_s=every_s, clock=clock, unknown=(RelayError,))
        self.names = sorted(set(names))
        self._held_up_s = held_up_s

    def current(self) -> tuple[Waiting, ...]:
        """The statements the last look found running or waiting, if that look is recent."""
        if self._clock() - self._looked_at > 3 * self.every_s:
            return ()
        return self._waits

    def held_up_s(self) -> float:
        return self._held_up_s()

    def _look(self) -> tuple[Waiting, ...]:
        with translated():
            return self._read(self.names)

    def _key(self, wait: Waiting) -> tuple[str, str | None]:
        return (wait.connection, wait.relation)

    def _lock_wait_fields(self, wait: Waiting) -> dict[str, Any]:
        return {"connection": wait.connection, "relation": wait.relation, "mode": wait.mode,
                "waited_s": round(wait.running_s, 1), "blocking_pids": [b.pid for b in wait.blockers],
                "blockers": [b.application_name for b in wait.blockers], "detail": wait.describe()}

    def _over_fields(self, keys: list[tuple[str, str | None]]) -> dict[str, Any]:
        return {"waited_on": sorted(str(relation) for _, relation in keys)}
