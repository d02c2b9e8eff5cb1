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
longer has) changes nothing: liveness fails as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from outbox_core.secrets import mask_text
from relay.db import connect, translated
from relay.errors import RelayError
from relay.queries import query

#: The relay held up this long (its loop, or its marks): look at what its statements wait on.
LOOK_AFTER_S = 5.0
#: How often the thread asks whether the relay is held up, and looks while it is.
LOOK_EVERY_S = 2.0
#: A lock wait that goes on is logged again this often.
LOG_EVERY_S = 30.0
#: How much of a blocking session's query is shown (masked: no DSN password).
QUERY_CHARS = 80


@dataclass(frozen=True, slots=True)
class Blocker:
    pid: int
    application_name: str
    state: str
    query: str


@dataclass(frozen=True, slots=True)
class Waiting:
    """One of the relay's sessions with a statement running on the server for a while."""

    pid: int
    connection: str  # its application_name: outbox-relay:<owner>[:mark|...]
    running_s: float
    wait_event_type: str | None  # "Lock", "IO", ... or None: running
    wait_event: str | None
    relation: str | None  # the relation whose lock it waits for
    mode: str | None  # the lock mode it asked for
    blockers: tuple[Blocker, ...]

    @property
    def on_lock(self) -> bool:
        return self.wait_event_type == "Lock"

    def describe(self) -> str:
        """One line for people: what waits, on what, for how long, behind whom."""
        what = (f"waiting on a lock on {self.relation or self.wait_event} for {self.running_s:.0f} s"
                if self.on_lock else
                f"running for {self.running_s:.0f} s (wait event: {self.wait_event or 'none'})")
        held = "; ".join(f"pid {b.pid} ({', '.join(filter(None, (b.application_name or 'no application_name', b.state)))})"
                         f": {b.query}" for b in self.blockers)
        return f"{self.connection} {what}" + (f", held by {held}" if held else "")


def waiting_from_row(row: Sequence[Any]) -> Waiting:
    """A :class:`Waiting` from a row of ``relay_waits``."""
    pid, name, running_s, event_type, event, relation, mode, blockers = row
    return Waiting(pid=int(pid), connection=str(name), running_s=float(running_s),
                   wait_event_type=event_type, wait_event=event, relation=relation, mode=mode,
                   blockers=tuple(Blocker(pid=int(b["pid"]), application_name=b.get("application_name") or "",
                                          state=b.get("state") or "",
                                          query=mask_text(b.get("query") or "")[:QUERY_CHARS])
                                  for b in blockers or ()))


class WaitWatch:
    """The watching thread; see the module's docstring.  ``start()``, idempotent ``stop()``,
    ``run_once()`` (one look when held up; tests call it)."""

    def __init__(self, dsn: str, *, application_name: str, names: Iterable[str],
                 held_up_s: Callable[[], float], on_lock_wait_s: Callable[[float], None],
                 log: Any, after_s: float = LOOK_AFTER_S, every_s: float = LOOK_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``names``: the application_names of the relay's connections; ``held_up_s``: how
        long the relay has been held up (0: moving); ``on_lock_wait_s``: the longest lock
        wait seen (the gauge)."""
        self._dsn, self._application_name = dsn, application_name[:63]
        self.names = sorted(set(names))
        self._held_up_s, self._on_lock_wait_s = held_up_s, on_lock_wait_s
        self.log, self.after_s, self.every_s, self._clock = log, after_s, every_s, clock
        self._conn: Any = None
        self._waits: tuple[Waiting, ...] = ()
        self._looked_at = float("-inf")
        self._logged: dict[tuple[str, str | None], float] = {}  # (connection, relation) -> when
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="outbox-relay-waits", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._close()

    def current(self) -> tuple[Waiting, ...]:
        """The statements the last look found running or waiting, if that look is recent."""
        if self._clock() - self._looked_at > 3 * self.every_s:
            return ()
        return self._waits

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.run_once()

    def run_once(self) -> tuple[Waiting, ...]:
        if self._held_up_s() < self.after_s:
            self._moving()
            return ()
        try:
            waits = self._look()
        except RelayError as exc:  # the database is away, or gives no connection: nothing known
            self.log.debug("database_waits_unknown", error=str(exc))
            self._close()
            waits = ()
        self._waits, self._looked_at = waits, self._clock()
        locks = [w for w in waits if w.on_lock]
        self._on_lock_wait_s(max((w.running_s for w in locks), default=0.0))
        now = self._clock()
        for wait in locks:
            key = (wait.connection, wait.relation)
            if now - self._logged.get(key, float("-inf")) >= LOG_EVERY_S:
                self._logged[key] = now
                self.log.warning("database_lock_wait", connection=wait.connection, relation=wait.relation,
                                 mode=wait.mode, waited_s=round(wait.running_s, 1),
                                 blocking_pids=[b.pid for b in wait.blockers],
                                 blockers=[b.application_name for b in wait.blockers],
                                 detail=wait.describe())
        return waits

    def _moving(self) -> None:
        """The relay moves again: say the wait is over, and give the connection back."""
        if self._logged:
            self.log.info("database_wait_over", waited_on=sorted(str(relation) for _, relation in self._logged))
            self._logged.clear()
            self._on_lock_wait_s(0.0)
        self._waits = ()
        self._close()

    def _look(self) -> tuple[Waiting, ...]:
        with translated():
            if self._conn is None or self._conn.closed:
                self._conn = connect(self._dsn, application_name=self._application_name, connect_timeout_s=3)
            rows = self._conn.execute(query("waits", "relay_waits"), {
                "names": self.names, "after_s": self.after_s, "query_chars": QUERY_CHARS * 2}).fetchall()
        return tuple(waiting_from_row(row) for row in rows)

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing a broken connection: nothing to do
                pass
