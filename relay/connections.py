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
never waits for, the mark, cleanup and exactly-once recovery connections on the thread
that uses them (relay/reopening.py):
after a database restart or failover one queued in the pooler held the loop, or marking,
cleanup or a shard's recovery, without a word.  A small batch the loop would mark itself
goes to the mark thread while the mark connection must be re-opened (``needs_reopen``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

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
        ``reopening`` that is :class:`Rechecked` (relay/reopening.py) is checked."""
        for each in reopening:
            if isinstance(each, Rechecked):
                each.checks = self


class Rechecked:
    """What re-opens a connection of its own at run time (relay/reopening.py: the LISTEN
    connection, the stores of the mark, cleanup and exactly-once threads, the replays'):
    once :meth:`Checks.check_reopens` gave it :attr:`checks` (after the start's check),
    each re-open is checked as at start."""

    checks: Checks | None = None


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
