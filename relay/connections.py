"""The database connections a relay holds, and a bounded wait for each at start.

A relay replica holds these connections for as long as it runs (``application_name`` in
brackets; relay/app.py):

1. claims, leases, dead letters, backlog gauges (``outbox-relay:<owner>``);
2. LISTEN and the wake-up lock (``outbox-relay-listen``);
3. marks (``outbox-relay:<owner>:mark``);
4. replays (``outbox-relay:<owner>:replay``);
5. retention and partitions, with ``--cleanup-retention-s`` or a partitioned outbox
   (``...:cleanup``);
6. exactly-once recovery, in that mode (``...:exactly-once``).

and, when it can get them, one more per ``--mark-connections`` above 1 (``...:mark2``, ...:
marks go on fewer connections without them, relay/marker.py).  Short-lived: one at start to
recognise a transaction pooler (``...:probe``), one while the relay is held up to see what
it waits on (``...:watch``, relay/waits.py).

Behind a session pooler (PgBouncer ``pool_mode = session``) each of them holds a server
connection for its whole life, and one the pool has no server for is accepted, then waits
at its first query in the pooler's queue, for ever or until ``query_wait_timeout``: the
relay stalled without a word (an operations audit, a pool of 3).  So at start
:func:`acquire` opens each connection and makes one round trip, in a thread of its own,
and says which it could not get within :data:`CONNECTION_WAIT_S` and how many the relay
needs, then keeps waiting (a server may come free) and says so again every
:data:`LOG_EVERY_S`.

The connections are checked the same way when re-opened at run time: the claims' by the
loop (:class:`Checks`), LISTEN's and the replays' on threads of their own that the loop
never waits for (:class:`CheckedWakeup`, :class:`ReopeningReplayer`), the mark, cleanup
and exactly-once recovery connections on the thread that uses them (:class:`CheckedStore`):
after a database restart or failover one queued in the pooler held the loop, or marking,
cleanup or a shard's recovery, without a word.  A small batch the loop would mark itself
goes to the mark thread while the mark connection must be re-opened (``needs_reopen``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NoReturn

from outbox_core.backoff import ceiling_s
from relay.errors import DatabaseUnavailable, RetriableError
from relay.store import Store
from relay.wakeup import REOPEN_BACKOFF_MAX_S, REOPEN_BACKOFF_S, NotListening, Opening, Wakeup

#: How long one connection may take to open and answer its first query before the relay
#: says it cannot get it.
CONNECTION_WAIT_S = 10.0
#: While it still waits, it says so again this often.
LOG_EVERY_S = 60.0


@dataclass(frozen=True, slots=True)
class Needed:
    """One connection the relay holds: its application_name, what it is for, and how to
    open it and make one round trip (raises the relay's database errors)."""

    name: str
    purpose: str
    open: Callable[[], object]
    #: A store of the loop's thread, re-opened after a database error the loop sees: checked
    #: again then (:meth:`Checks.reopened`).  LISTEN's re-opens itself (:class:`CheckedWakeup`).
    recheck: bool = False


def needs_text(needed: Sequence[Needed], optional: int = 0) -> str:
    """``the relay needs 4 connections: claims and leases (outbox-relay:a), ...``."""
    listed = ", ".join(f"{n.purpose} ({n.name})" for n in needed)
    more = f", and up to {optional} more for marks if it can get them (--mark-connections)" if optional else ""
    return f"the relay needs {len(needed)} connections: {listed}{more}"


def acquire(needed: Sequence[Needed], *, log: Any, stopping: Callable[[], bool], optional: int = 0,
            within_s: float = CONNECTION_WAIT_S, clock: Callable[[], float] = time.monotonic,
            reopened: bool = False) -> None:
    """Open every connection of ``needed`` in turn (with ``reopened``, only the loop's stores),
    each in a thread of its own, waiting as long as it takes (until ``stopping``); one that
    takes longer than ``within_s`` is logged (``database_connection_waiting``).  Errors of
    an attempt are raised."""
    for number, connection in enumerate(needed, start=1):
        if reopened and not connection.recheck:
            continue
        _open_one(connection, number, needed, log=log, stopping=stopping, optional=optional,
                  within_s=within_s, clock=clock, reopened=reopened)
        if stopping():
            return


class Checks:
    """The relay's connections (:func:`relay_needs`), all checked at start, and the loop's
    again when it re-opens them after the database went away: behind a session pooler with
    no server free, one of them waited at its first statement and held the loop there
    without a word until liveness failed.  Owned by the loop's thread."""

    def __init__(self, needed: Sequence[Needed], *, log: Any, stopping: Callable[[], bool],
                 optional: int = 0) -> None:
        self.needed, self.log, self.stopping, self.optional = list(needed), log, stopping, optional

    def at_start(self) -> None:
        acquire(self.needed, log=self.log, stopping=self.stopping, optional=self.optional)

    def reopened(self) -> bool:
        """The loop's stores after the database went away; False: stopped meanwhile."""
        acquire(self.needed, log=self.log, stopping=self.stopping, optional=self.optional, reopened=True)
        return not self.stopping()

    def reopen(self, name: str, open_: Callable[[], object], *,
               abandoned: Callable[[], bool] = lambda: False) -> bool:
        """Re-open the connection ``name`` with ``open_``, checked as at start, on the calling
        thread (any: the mark and cleanup threads' too); False: stopped, or ``abandoned``,
        before it opened.  A name not needed at start is one of the optional mark
        connections (``:mark2``...)."""
        number, connection = next(((i, n) for i, n in enumerate(self.needed, start=1) if n.name == name),
                                  (len(self.needed) + 1, Needed(name, "marks, optional", open_)))
        return _open_one(replace(connection, open=open_), number, self.needed, log=self.log,
                         stopping=lambda: self.stopping() or abandoned(), optional=self.optional,
                         within_s=CONNECTION_WAIT_S, clock=time.monotonic, reopened=True)

    def check_reopens(self, *reopening: object) -> None:
        """From now on (after :meth:`at_start`), each re-open of the connection of each of
        ``reopening`` that is a :class:`CheckedWakeup`, a :class:`CheckedStore` or a
        :class:`ReopeningReplayer` is checked."""
        for each in reopening:
            if isinstance(each, (CheckedWakeup, CheckedStore, ReopeningReplayer)):
                each.checks = self


class CheckedWakeup(Wakeup):
    """The LISTEN connection (relay/wakeup.py), which re-opens itself when it broke, without
    the loop seeing a database error: once :attr:`checks` is set (after the start's check),
    each re-open is checked as at start, on a thread of its own (``outbox-relay-listen-reopen``),
    and the loop never waits for it.  LISTEN only speeds discovery: behind a session pooler
    with no server free, the re-open waited at its first statement on the loop's thread and
    held the loop there (no claim, no mark, the claims connection working).  Now the loop
    goes on polling (``Wakeup.not_listening``) and adopts the connection, its LISTEN
    statements run, once ready; a failed attempt is tried again after the back-off of
    :data:`relay.wakeup.REOPEN_BACKOFF_S`, a fatal one (rejected credentials) raised on the
    loop's thread.  :meth:`close` (database lost, relay stopping) abandons an attempt."""

    checks: Checks | None = None
    _opening: Opening | None = None  # the re-open under way; the loop's thread's

    def _listening(self) -> Any:
        if self.checks is None or (self._conn is not None and not self._conn.closed):
            return super()._listening()
        opening = self._opening
        if opening is None:
            if self._clock() < self._reopen_at:
                raise NotListening()  # the back-off after a failed attempt
            self._opening = opening = self._open_in_background(self.checks)
        if not opening.done.is_set():
            raise NotListening(opening.done)
        self._opening = None
        conn = opening.take()
        if conn is not None:
            return self._adopt(conn)
        if opening.error is not None and not isinstance(opening.error, RetriableError):
            raise opening.error
        self._reopen_failures += 1
        self._reopen_at = self._clock() + ceiling_s(self._reopen_failures, initial_s=REOPEN_BACKOFF_S,
                                                    max_s=REOPEN_BACKOFF_MAX_S)
        raise NotListening()

    def _open_in_background(self, checks: Checks) -> Opening:
        opening = Opening()

        def reopen() -> None:
            try:
                if not checks.reopen(LISTEN[0], lambda: opening.put(self._open_listening(lambda: None)),
                                     abandoned=lambda: opening.abandoned):
                    opening.abandon()  # stopped: whatever comes is closed
            except BaseException as exc:  # noqa: BLE001 - read by the loop's thread (_listening)
                opening.fail(exc)

        threading.Thread(target=reopen, daemon=True, name="outbox-relay-listen-reopen").start()
        return opening

    def close(self) -> None:
        super().close()
        if self._opening is not None:
            self._opening.abandon()
            self._opening = None


class CheckedStore(Store):
    """A store used on a thread of its own (the mark threads', relay/marker.py, the cleanup
    thread's, relay/janitor.py, the exactly-once shard workers', relay/exactly_once.py),
    whose connection re-opens at its next statement after it broke: once :attr:`checks` is
    set, each re-open is checked as at start on the thread that needs it.  Behind a session pooler with no server free, a re-opened mark
    connection waited at its first statement and marking stopped without a word.  The
    check runs only when the connection is re-opened, never per statement; the first open
    of an optional mark connection is its lane's probe's (relay/marker.py), not checked.  A
    stop of the relay ends a wait within half a second, during the drain too: the statement
    raises DatabaseUnavailable (a mark's rows stay pending), the thread goes on to its end."""

    checks: Checks | None = None
    _opened = False  # it had a connection: the next open is a re-open
    #: The connection it had is closed or broke (this store's test before it re-opens): its
    #: next statement re-opens it, and may wait.  A plain attribute, kept as the connection
    #: closes and opens, so that the pump's test before a mark on its own thread costs one
    #: look (relay/pump_settle.py: such a mark goes to the mark thread instead).
    #: Not derivable from the connection: it turns False only once the re-open's check
    #: returned (its first round trip answered), while the store has a connection object as
    #: soon as PgBouncer in session mode accepts the client, before a server is free.  A
    #: property reading the connection let the wait watch look (relay/app.py) and take the
    #: server the re-open waited for: the relay stalled (CI, reverted in 8b16bdb).
    needs_reopen = False

    @property
    def conn(self) -> Any:
        current = self._conn
        if current is not None and not current.closed:
            return current
        if self.checks is None or not self._opened:
            current = super().conn
            self._opened = True
        elif not self.checks.reopen(self._application_name, self._open):
            raise DatabaseUnavailable(f"stopped while waiting for the connection {self._application_name}")
        else:
            current = super().conn
        self.needs_reopen = False
        return current

    def close(self) -> None:
        super().close()
        self.needs_reopen = self._opened

    def _failed(self, exc: Any) -> NoReturn:
        try:
            super()._failed(exc)
        finally:  # one the driver found broken without an error that drops it
            current = self._conn
            self.needs_reopen = self._opened and (current is None or current.closed)

    def _open(self) -> object:
        return super().conn


class ReopeningReplayer:
    """The replayer (relay/replay.py) as the loop runs it: when a statement on its connection
    (``...:replay``) fails, that re-opens on a thread of its own, checked as at start, and
    replays wait meanwhile (after a failed re-open, :data:`relay.wakeup.REOPEN_BACKOFF_S`
    doubling); the loop neither waits for it nor touches the store until it ended.  Before,
    that break alone was the database down (database_unavailable, a rewind, LISTEN dropped),
    and behind a session pooler with no server free the re-open (Checks.reopened) held the
    loop: no claim, mark or heartbeat, for replays.  The claims say whether the database is
    down.  Owned by the loop's thread."""

    checks: Checks | None = None

    def __init__(self, replayer: Any, store: Any, *, name: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``store``: the replayer's; ``name``: its connection's application_name."""
        self.replayer, self._store, self._name, self._clock = replayer, store, name, clock
        self._broken = False  # its connection must be re-opened before a replay runs
        self._reopening: threading.Event | None = None
        self._failed: list[BaseException] = []
        self._failures, self._retry_at = 0, 0.0

    def run_once(self, leases: Sequence[Any]) -> Any:
        if not self._usable():
            return None
        try:
            return self.replayer.run_once(leases)
        except DatabaseUnavailable:
            if self.checks is None:
                raise
            self._store.close()  # re-opened by the next turn, on a thread of its own
            self._broken, self._retry_at = True, 0.0
            return None

    def busy(self) -> bool:
        return not self._broken and bool(self.replayer.busy())

    def wait(self, timeout_s: float) -> None:
        self.replayer.wait(timeout_s)

    def _usable(self) -> bool:
        done = self._reopening
        if done is not None:
            if not done.is_set():
                return False
            self._reopening = None
            if not self._failed:
                self._broken, self._failures = False, 0
                return True
            error = self._failed.pop()
            if not isinstance(error, RetriableError):
                raise error
            self._failures += 1
            self._retry_at = self._clock() + ceiling_s(self._failures, initial_s=REOPEN_BACKOFF_S,
                                                       max_s=REOPEN_BACKOFF_MAX_S)
        if self._broken and self.checks is not None and self._clock() >= self._retry_at:
            self._reopening = self._reopen(self.checks)
        return not self._broken

    def _reopen(self, checks: Checks) -> threading.Event:
        done = threading.Event()

        def reopen() -> None:
            try:
                checks.reopen(self._name, self._store.ping)
            except BaseException as exc:  # noqa: BLE001 - read by the loop's thread (_usable)
                self._failed.append(exc)
            finally:
                done.set()

        threading.Thread(target=reopen, daemon=True, name="outbox-relay-replay-reopen").start()
        return done


def _open_one(connection: Needed, number: int, needed: Sequence[Needed], *, log: Any,
              stopping: Callable[[], bool], optional: int, within_s: float,
              clock: Callable[[], float], reopened: bool) -> bool:
    """Open ``connection``; False: stopped before it opened (its attempt goes on, abandoned)."""
    done = threading.Event()
    failed: list[BaseException] = []

    def attempt() -> None:
        try:
            connection.open()
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread below
            failed.append(exc)
        finally:
            done.set()

    began = clock()
    threading.Thread(target=attempt, daemon=True, name=f"outbox-relay-connect-{number}").start()
    wait_s, warned = within_s, False
    while not done.wait(min(wait_s, 0.5)) and not stopping():
        waited = clock() - began
        if waited < wait_s:
            continue
        warned = True
        wait_s = waited + LOG_EVERY_S
        log.warning("database_connection_waiting", connection=connection.name, number=number,
                    needed=len(needed), waited_s=round(waited, 1), reopened=reopened,
                    detail=f"could not get {_which(number, needed)} ({connection.name}: "
                           f"{connection.purpose}) within {waited:.0f} s: a pooler with fewer server "
                           f"connections than the relay needs? {needs_text(needed, optional)}; "
                           f"still waiting for it")
    if failed:
        raise failed[0]
    if warned and done.is_set():
        log.info("database_connection_ready", connection=connection.name, number=number,
                 waited_s=round(clock() - began, 1), reopened=reopened)
    return done.is_set()


def _which(number: int, needed: Sequence[Needed]) -> str:
    """``connection 3 of 4``, or ``an optional connection`` (a mark connection past the first)."""
    return f"connection {number} of {len(needed)}" if number <= len(needed) else "an optional connection"


#: The relay's own connections, role -> what it is for, in the order it opens them (the
#: role ends the application_name, ``outbox-relay:<owner><role>``; :func:`relay_needs` puts
#: LISTEN's second).  The one list behind the start-up check and the wait watch's names.
ROLES = {"": "claims and leases", ":mark": "marks", ":replay": "replays",
         ":cleanup": "retention and partitions", ":exactly-once": "exactly-once recovery"}
#: The roles of the stores the loop re-opens after a database error (relay/app.py; LISTEN's
#: and the replays' re-open on threads of their own).
LOOP_ROLES = ("",)
#: The LISTEN connection's name, whatever the owner (relay/wakeup.py), and its purpose.
LISTEN = ("outbox-relay-listen", "LISTEN and the wake-up lock")


def application_name(owner: str, role: str) -> str:
    """``outbox-relay:<owner><role>``, the owner cut so that the whole fits PostgreSQL's 63
    characters with the role kept (``:mark``, ``:probe``): the server cut the end, and a long
    ``--owner`` showed every connection of the replica under the same name."""
    return f"outbox-relay:{owner}"[: 63 - len(role)] + role


def mark_role(index: int) -> str:
    """The role of the ``index``-th mark connection (from 0): ``:mark``, ``:mark2``, ..."""
    return ":mark" + (str(index + 1) if index else "")


def relay_needs(name: Callable[[str], str], *, store: Any, wakeup: Any, mark_store: Any,
                replay_store: Any, cleanup_store: Any = None, recovery_store: Any = None) -> list[Needed]:
    """The connections of :data:`ROLES`, LISTEN's second (``name(role)``: the
    application_name of a role; a store that is None is not needed)."""
    stores = {"": store, ":mark": mark_store, ":replay": replay_store, ":cleanup": cleanup_store,
              ":exactly-once": recovery_store}
    needed = [Needed(name(role), purpose, stores[role].ping, recheck=role in LOOP_ROLES)
              for role, purpose in ROLES.items() if stores[role] is not None]
    needed.insert(1, Needed(*LISTEN, wakeup.ping))
    return needed


def watched_names(name: Callable[[str], str], *, marks: int) -> list[str]:
    """The application_names of :data:`ROLES` with each of the ``marks`` mark connections:
    the connections whose statements may wait on the outbox (relay/waits.py)."""
    roles = [role for role in ROLES if role != ":mark"] + [mark_role(i) for i in range(marks)]
    return [name(role) for role in roles]
