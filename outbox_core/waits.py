"""What a service's own sessions wait on in the database, read while they seem held up.

The relay (``relay.waits``), the inbox consumer (``consumer_sdk.inbox_waits``) and the jobs
worker pool (``consumer_sdk.jobs.lock_waits``) each wait without a word on a lock another
session holds: a DBA's ``LOCK TABLE``, a migration waiting for its own lock with others
queued behind it, a transaction left open on the rows they need.  Nothing times out; the
wait ends when the blocking transaction does.  Each of them runs a :class:`SessionWatch`:

* a thread that asks every ``every_s`` whether its service has been held up for ``after_s``
  (:meth:`SessionWatch.held_up_s`: each says what held up means to it), and only then looks;
* the look: on a connection of its own (made by the service's factory, opened for the look
  and closed once the service moves again) the catalog read ``waits.sql`` ``relay_waits``
  (``pg_stat_activity``, ``pg_locks``, ``pg_blocking_pids``: catalog views only, nothing
  that could wait on the service's tables), as :class:`Waiting` rows;
* a lock wait logged once every :data:`LOG_EVERY_S` per key (each service says what makes
  two waits the same one, and what its log line carries: a hint a person can act on), and
  one line when it is over;
* the gauge (``report``): the longest lock wait the last look saw, 0 when none, when the
  look could not be made, once the service moves again and once the watch stops.

The SQL text is given by the caller (``statement``), loaded by its own package's loader.
A database that does not answer changes nothing: the look is logged at debug level
(``database_waits_unknown``) and its connection dropped.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from outbox_core.secrets import mask_text
from outbox_core.streaks import FailureStreak

__all__ = ["LOG_EVERY_S", "LOOK_AFTER_S", "LOOK_EVERY_S", "QUERY_CHARS", "Blocker", "SessionWatch", "Waiting",
           "held_by", "waiting_from_row"]

#: Held up this long: look at what the service's statements wait on.
LOOK_AFTER_S = 5.0
#: How often the thread asks whether the service is held up, and looks while it is.
LOOK_EVERY_S = 2.0
#: A lock wait that goes on is logged again this often.
LOG_EVERY_S = 30.0
#: How much of a blocking session's query is shown (masked: no DSN password).
QUERY_CHARS = 80

#: What makes two looks' lock waits the same wait (logged once every LOG_EVERY_S).
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Blocker:
    """A session holding up a waiting one, as the waiting service's role may see it."""

    pid: int
    application_name: str
    state: str
    query: str  # masked, at most QUERY_CHARS; "<insufficient privilege>" for another role's


@dataclass(frozen=True, slots=True)
class Waiting:
    """One of the service's sessions with a statement running on the server for a while."""

    pid: int
    connection: str  # its application_name
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


def held_by(blockers: Iterable[Blocker]) -> str:
    """``backend pid <pid> (<application_name>, <state>): <query>; ...``: whom to look for."""
    return "; ".join(f"backend pid {b.pid} ({b.application_name or 'no application_name'}, {b.state})"
                     f": {b.query}" for b in blockers)


def waiting_from_row(row: Sequence[Any]) -> Waiting:
    """A :class:`Waiting` from a row of ``relay_waits``."""
    pid, name, running_s, event_type, event, relation, mode, blockers = row
    return Waiting(pid=int(pid), connection=str(name), running_s=float(running_s),
                   wait_event_type=event_type, wait_event=event, relation=relation, mode=mode,
                   blockers=tuple(Blocker(pid=int(b["pid"]), application_name=b.get("application_name") or "",
                                          state=b.get("state") or "",
                                          query=mask_text(b.get("query") or "")[:QUERY_CHARS])
                                  for b in blockers or ()))


class SessionWatch(ABC, Generic[K]):
    """The watching thread; see the module's docstring.  ``start()``, idempotent ``stop()``,
    ``run_once()`` (one look when held up; tests call it).

    A service says what differs in a subclass: :meth:`held_up_s` (when to look),
    :meth:`_look` (which sessions, usually :meth:`_read` of their application_names),
    :meth:`_key`, :meth:`_lock_wait_fields` and :meth:`_over_fields` (its log lines).
    ``connect``: a new connection of the service's kind; ``statement``: the ``relay_waits``
    text; ``report``: the gauge's setter (seconds); ``unknown``: the errors of a look that
    mean "the database is away" (anything else is a bug and ends the thread)."""

    #: The log lines' events, and the watch thread's name.
    lock_wait_event = "database_lock_wait"
    over_event = "database_wait_over"
    thread_name = "outbox-waits"

    def __init__(self, connect: Callable[[], Any], *, statement: str, log: Any,
                 report: Callable[[float], None] | None = None, after_s: float = LOOK_AFTER_S,
                 every_s: float = LOOK_EVERY_S, clock: Callable[[], float] = time.monotonic,
                 unknown: tuple[type[BaseException], ...] = (Exception,)) -> None:
        self._connect, self._statement, self._report_to, self._unknown = connect, statement, report, unknown
        self.log, self.after_s, self.every_s, self._clock = log, after_s, every_s, clock
        self._conn: Any = None
        self._reported = 0.0  # the gauge's last value
        self._waits: tuple[Waiting, ...] = ()  # what the last look found, and when
        self._looked_at = float("-inf")
        self._logged: dict[K, FailureStreak] = {}  # the lock waits logged, by key: each one's looks
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what a service says ----------------------------------------------------------------

    @abstractmethod
    def held_up_s(self) -> float:
        """How long the service has been held up (0: it moves, or has no session to look at)."""

    @abstractmethod
    def _look(self) -> tuple[Waiting, ...]:
        """The service's sessions running or waiting for ``after_s``: usually :meth:`_read`."""

    @abstractmethod
    def _key(self, wait: Waiting) -> K:
        """Two looks finding the same key see the same wait: logged once every LOG_EVERY_S."""

    @abstractmethod
    def _lock_wait_fields(self, wait: Waiting) -> dict[str, Any]:
        """The lock-wait line's fields."""

    @abstractmethod
    def _over_fields(self, keys: list[K]) -> dict[str, Any]:
        """The "over" line's fields, from the keys logged."""

    # -- the thread --------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Idempotent; the gauge goes back to 0.  A thread still in a look after ``timeout_s``
        (a database that does not answer) closes its connection itself when the look ends:
        a connection another thread uses is not closed under it."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        if thread is None or not thread.is_alive():
            self._close()
        self._report(0.0)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.every_s):
                self.run_once()
        finally:
            self._close()

    def run_once(self) -> tuple[Waiting, ...]:
        """One look when the service has been held up for ``after_s``: every wait found (the
        lock waits logged and reported as the module says); () when it moves."""
        if self.held_up_s() < self.after_s:
            self._moving()
            return ()
        try:
            waits = self._look()
        except self._unknown as exc:  # the database is away, or gives no connection: nothing known
            self.log.debug("database_waits_unknown", error=mask_text(str(exc)))
            self._close()
            waits = ()
        self._waits, self._looked_at = waits, self._clock()
        locks = [w for w in waits if w.on_lock]
        self._report(max((w.running_s for w in locks), default=0.0))
        now = self._clock()
        for wait in locks:
            if self._logged.setdefault(self._key(wait), FailureStreak(every_s=LOG_EVERY_S)).failed(now):
                self.log.warning(self.lock_wait_event, **self._lock_wait_fields(wait))
        return waits

    def _read(self, names: Iterable[str]) -> tuple[Waiting, ...]:
        """The sessions called ``names`` with a statement running for ``after_s`` or more, read
        on the watch's connection (opened when needed; no transaction left open)."""
        if self._conn is None or self._conn.closed:
            self._conn = self._connect()
        conn = self._conn
        rows = conn.execute(self._statement, {"names": sorted(set(names)), "after_s": self.after_s,
                                              "query_chars": QUERY_CHARS * 2}).fetchall()
        if not conn.autocommit:
            conn.rollback()  # a factory of the service's own: no transaction left open
        return tuple(waiting_from_row(row) for row in rows)

    def _report(self, seconds: float) -> None:
        """The gauge follows every look; back to 0 once (not at every tick while idle)."""
        if self._report_to is not None and (seconds or self._reported):
            self._report_to(seconds)
        self._reported = seconds

    def _moving(self) -> None:
        """The service moves again: say a wait logged is over, and give the connection back."""
        self._report(0.0)
        if self._logged:
            self.log.info(self.over_event, **self._over_fields(list(self._logged)))
            self._logged.clear()
        self._waits = ()
        self._close()

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing a connection the server may have dropped
                pass
