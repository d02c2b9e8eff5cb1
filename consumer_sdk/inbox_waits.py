"""What the consumer's own transaction waits on in the database, when a batch takes long.

A handler hung past ``max.poll.interval.ms`` leaves the group with its transaction open and
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
every :data:`LOG_EVERY_S`; the gauge follows every look, so an alert can hold on it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from outbox_core.queries import query
from outbox_core.secrets import mask_text

#: A batch in the works this long: look at what the consumer's statement waits on.
LOOK_AFTER_S = 5.0
#: How often the thread asks whether a batch takes long, and looks while it does.
LOOK_EVERY_S = 2.0
#: A lock wait that goes on is logged again this often.
LOG_EVERY_S = 30.0
#: How much of a blocking session's query is shown (masked: no DSN password).
QUERY_CHARS = 80

_HINT = ("the consumer's transaction waits until the blocking one ends; another member of this "
         "consumer's group holding it is most likely a member that left the group with its transaction "
         "open (a handler hung past max.poll.interval.ms): end its handler, or that backend "
         "(pg_terminate_backend(pid)); the event is then applied once")


class LockWaitWatch:
    """The watching thread; see the module's docstring.  ``start()``, idempotent ``stop()``,
    ``run_once()`` (one look when a batch takes long; tests call it).

    ``session``: the consumer's own session as ``(backend pid, application_name)``, None
    while it has none; ``busy_s``: how long the current batch has been in the works (0:
    none is); ``wait_gauge``: the gauge (``.set(seconds)``) the looks report to."""

    def __init__(self, connect: Callable[[], Any], *, session: Callable[[], tuple[int, str] | None],
                 busy_s: Callable[[], float], log: Any, after_s: float = LOOK_AFTER_S,
                 every_s: float = LOOK_EVERY_S, clock: Callable[[], float] = time.monotonic,
                 wait_gauge: Any = None) -> None:
        self._connect, self._session, self._busy_s = connect, session, busy_s
        self._gauge = wait_gauge
        self.log, self.after_s, self.every_s, self._clock = log, after_s, every_s, clock
        self._conn: Any = None
        self._logged: dict[int, float] = {}  # blocking pid -> when logged
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="outbox-consumer-waits", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self._close()
        self._report([])

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.run_once()

    def run_once(self) -> list[dict[str, Any]]:
        """One look, when a batch has taken ``after_s``: the lock waits of the consumer's
        session found (logged as the module says)."""
        session = self._session()
        if session is None or self._busy_s() < self.after_s:
            self._moving()
            return []
        try:
            waits = self._look(*session)
        except Exception as exc:  # noqa: BLE001 - the database is away: nothing known, nothing changed
            self.log.debug("database_waits_unknown", error=mask_text(str(exc)))
            self._close()
            waits = []
        self._report(waits)
        now = self._clock()
        for wait in waits:
            blockers = wait["blockers"]
            key = min((b["pid"] for b in blockers), default=0)
            if now - self._logged.get(key, float("-inf")) >= LOG_EVERY_S:
                self._logged[key] = now
                self.log.warning("database_lock_wait", pid=wait["pid"], lock=wait["lock"], mode=wait["mode"],
                                 relation=wait["relation"], waited_s=wait["waited_s"],
                                 blocking_pids=[b["pid"] for b in blockers],
                                 blockers=[b["application_name"] for b in blockers],
                                 detail=_describe(wait), hint=_HINT)
        return waits

    def _look(self, pid: int, application_name: str) -> list[dict[str, Any]]:
        if self._conn is None or self._conn.closed:
            self._conn = self._connect()
        rows = self._conn.execute(query("waits", "relay_waits"), {
            "names": [application_name], "after_s": self.after_s, "query_chars": QUERY_CHARS * 2}).fetchall()
        if not self._conn.autocommit:
            self._conn.rollback()  # a factory of the service's own: no transaction left open
        return [_wait(row) for row in rows if int(row[0]) == pid and row[3] == "Lock"]

    def _report(self, waits: list[dict[str, Any]]) -> None:
        """Set the gauge to the longest of ``waits`` (0 when none)."""
        if self._gauge is not None:
            self._gauge.set(max((w["waited_s"] for w in waits), default=0.0))

    def _moving(self) -> None:
        """No batch takes long: say a wait logged is over, and give the connection back."""
        self._report([])
        if self._logged:
            self.log.info("database_wait_over", blocking_pids=sorted(self._logged))
            self._logged.clear()
        self._close()

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing a connection the server may have dropped
                pass


def _wait(row: Any) -> dict[str, Any]:
    """A lock wait from a row of ``relay_waits``."""
    pid, _name, running_s, _event_type, event, relation, mode, blockers = row
    return {"pid": int(pid), "waited_s": round(float(running_s), 1), "lock": event, "relation": relation,
            "mode": mode,
            "blockers": [{"pid": int(b["pid"]), "application_name": b.get("application_name") or "",
                          "state": b.get("state") or "", "query": mask_text(b.get("query") or "")[:QUERY_CHARS]}
                         for b in blockers or ()]}


def _describe(wait: dict[str, Any]) -> str:
    """One line for people: what waits, on what, for how long, behind whom."""
    on = wait["relation"] or wait["lock"] or "a lock"
    held = "; ".join(f"backend pid {b['pid']} ({b['application_name'] or 'no application_name'}, {b['state']})"
                     f": {b['query']}" for b in wait["blockers"])
    return (f"the consumer's statement has waited {wait['waited_s']:.0f} s on a lock ({on}, {wait['mode']})"
            + (f", held by {held}" if held else ""))
