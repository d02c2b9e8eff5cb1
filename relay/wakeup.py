"""LISTEN/NOTIFY and the wake-up lock: how an idle relay sleeps and is woken (an adapter).

One connection of its own (``outbox-relay-listen``), used only by the loop's thread.
Asleep, the relay holds a session advisory lock on it; while some relay holds that
lock, writers NOTIFY on the outbox channel (sql/migrations/0003_notify.sql), and the
sleeping relay waits on the connection's socket.  Awake, nobody holds the lock and
writers pay nothing.  The loop (relay/loop.py) decides when to sleep and wake; this
module only talks to PostgreSQL.

The same connection listens for the replicas' notices that shards change hands
(``outbox_relay_shards``, relay/leases.py): :meth:`Wakeup.shards_moved` takes them
without waiting, and :meth:`Wakeup.wait` returns early on one.

LISTEN/NOTIFY only speeds discovery: the claims' poll is the truth.  So the relay's
re-open of a LISTEN connection that broke (relay/reopening.py, ``CheckedWakeup``) runs
on a thread of its own, and the loop never waits for it: until the loop's thread adopts
the new connection, :class:`NotListening` is raised inside, and :meth:`Wakeup.set_sleeping`
refuses the lock (``not_listening``: the loop then claims at its poll interval),
:meth:`Wakeup.wait` waits its timeout (less once the connection is ready) and
:meth:`Wakeup.shards_moved` reads no notice.  The notices about shards sent meanwhile are
not heard: the lease heartbeat's interval still covers them, as when one is missed.
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable
from typing import Any, Self

import psycopg

from outbox_core.backoff import ceiling_s
from relay.db import connect, translated
from relay.errors import RetriableError
from relay.queries import query

NOTIFY_CHANNEL = "outbox_relay"
SHARDS_CHANNEL = "outbox_relay_shards"
#: A LISTEN connection that could not be opened for :meth:`Wakeup.shards_moved` is tried
#: again after this back-off, doubled at each failure up to the cap: the loop looks for
#: notices every 0.1 s, and each attempt is a connection the server must refuse (a
#: database at its connection limit) that the loop's thread waits on.
REOPEN_BACKOFF_S, REOPEN_BACKOFF_MAX_S = 1.0, 30.0
#: The statements that make a new connection the LISTEN connection (sql/queries/relay.sql).
LISTEN_STATEMENTS = ("keep_session", "listen", "listen_shards")


class NotListening(Exception):
    """No LISTEN connection yet: one is being opened on another thread, or is tried again
    after a back-off (relay/reopening.py).  ``ready``, when given, is set once the
    attempt ended (opened, failed or given up): the loop's thread may then adopt it."""

    def __init__(self, ready: threading.Event | None = None) -> None:
        super().__init__("the LISTEN connection is being re-opened")
        self.ready = ready


class ReopenBackOff:
    """A connection's re-opens that failed in a row, and when the next one is due: after
    failure number n, :data:`REOPEN_BACKOFF_S` doubled n - 1 times, up to
    :data:`REOPEN_BACKOFF_MAX_S`.  One copy for the LISTEN connection's (:meth:`Wakeup.shards_moved`,
    relay/reopening.py ``CheckedWakeup``) and the replays' (``ReopeningReplayer``): each
    kept its own count and sum before.  Owned by one thread (the loop's)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.failures = 0  # in a row
        self._due_at = 0.0  # no attempt before then (clock)

    def due(self) -> bool:
        """May an attempt start now?"""
        return self._clock() >= self._due_at

    def failed(self) -> bool:
        """An attempt failed: the next waits for the back-off.  True for the first failure
        of a streak, the one worth a log line."""
        self.failures += 1
        self._due_at = self._clock() + ceiling_s(self.failures, initial_s=REOPEN_BACKOFF_S,
                                                 max_s=REOPEN_BACKOFF_MAX_S)
        return self.failures == 1

    def passed(self) -> int:
        """An attempt opened the connection: the streak ends.  Returns how many attempts
        had failed in it (0: none)."""
        failures, self.failures = self.failures, 0
        return failures


class Attempt:
    """A re-open run on a thread of its own (:meth:`start`) and read by the loop's thread
    once ``done`` is set: ``error`` is its failure (None: it opened, or was given up).
    The loop's thread never waits for it (relay/reopening.py)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None

    def start(self, thread_name: str, reopen: Callable[[], object]) -> Self:
        """Run ``reopen`` on a daemon thread named ``thread_name``; returns this attempt."""

        def run() -> None:
            try:
                reopen()
            except BaseException as exc:  # noqa: BLE001 - read by the loop's thread
                self.fail(exc)
            finally:
                self.done.set()

        threading.Thread(target=run, daemon=True, name=thread_name).start()
        return self

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


class Opening(Attempt):
    """A LISTEN connection opened on another thread and handed to the loop's thread, which
    adopts it with :meth:`take`; a connection that comes after :meth:`abandon` (the relay
    stops, or dropped the attempt) is closed, never handed over."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None
        self._abandoned = False

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def put(self, conn: psycopg.Connection[Any]) -> None:
        """The attempt's thread: the connection is open and listening."""
        with self._lock:
            kept = not self._abandoned
            if kept:
                self._conn = conn
        if not kept:
            _close(conn)
        self.done.set()

    def take(self) -> psycopg.Connection[Any] | None:
        """The loop's thread: the connection, once (None: none came)."""
        with self._lock:
            conn, self._conn = self._conn, None
        return conn

    def abandon(self) -> None:
        """Nobody will adopt it: close what came or will come."""
        with self._lock:
            self._abandoned = True
            conn, self._conn = self._conn, None
        if conn is not None:
            _close(conn)
        self.done.set()


def _close(conn: psycopg.Connection[Any]) -> None:
    try:
        conn.close()
    except psycopg.Error:
        pass


class Wakeup:
    """The LISTEN connection and the wake-up lock.  Owned by the loop's thread; not thread-safe."""

    def __init__(self, dsn: str, *, application_name: str = "outbox-relay-listen", owner: str = "",
                 on_statement: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``owner``: this replica, whose own notices about shards are not news."""
        self._dsn = dsn
        #: Failed opens of the LISTEN connection: shards_moved opens none before it is due.
        self._reopen = ReopenBackOff(clock)
        self._owner = owner
        self._woken = False  # an outbox notification taken by shards_moved, for wait()
        self._moved = False  # a peer's notice that shards change hands, for shards_moved()
        self._application_name = application_name[:63]
        self._on_statement = on_statement
        self._conn: psycopg.Connection[Any] | None = None
        self.queries = 0  # statements sent, for the idle-cost figures
        self.sleeping = False  # holds the wake-up lock on the LISTEN connection
        #: The last refused set_sleeping(True) found another relay holding the lock (not
        #: writers mid-transaction): writers notify this relay too.
        self.peer_sleeps = False
        #: The last refused set_sleeping(True) found no LISTEN connection (being re-opened,
        #: :class:`NotListening`): nothing can wake this relay, its poll finds the rows.
        self.not_listening = False

    def set_sleeping(self, sleeping: bool) -> bool:
        """Take (True) or release (False) the wake-up lock on the LISTEN connection.

        While a relay holds it, writers NOTIFY (sql/migrations/0003_notify.sql).
        Returns whether this relay now holds it.  A broken connection loses it.

        The connection idles while the relay is awake, so something other than the
        database being down can end it (a server's ``idle_session_timeout``, a firewall,
        ``pg_terminate_backend``).  Going to sleep on a connection that broke so tries
        again on a fresh one; waking on one only drops it (the lock went with it).  A
        fresh connection that fails raises the relay's database error, as before: the
        database is what is down then.  One being re-opened on another thread
        (:class:`NotListening`) refuses the lock: ``not_listening``, the loop polls.
        """
        had_connection = self._conn is not None and not self._conn.closed
        if not sleeping and not had_connection:
            self.sleeping = False  # no connection, no lock
            return False
        try:
            return self._lock_state(sleeping)
        except NotListening:
            return self._refused_not_listening()
        except RetriableError:
            self.close()  # the lock, if it was held, went with the connection
            if not sleeping:
                return False
            if not had_connection:
                raise
        try:
            return self._lock_state(True)  # the idle connection had broken: a fresh one
        except NotListening:
            return self._refused_not_listening()
        except RetriableError:
            self.close()
            raise

    def _refused_not_listening(self) -> bool:
        self.sleeping = self.peer_sleeps = False
        self.not_listening = True
        return False

    def _lock_state(self, sleeping: bool) -> bool:
        with translated():
            listen = self._listening()
            self.not_listening = False
            self._count()
            if sleeping:
                row = listen.execute(query("relay", "go_to_sleep")).fetchone()
                self.sleeping = bool(row and row[0])
                self.peer_sleeps = bool(row and row[1])
            else:
                listen.execute(query("relay", "wake_up"))
                self.sleeping = False
            return self.sleeping

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for a NOTIFY on the outbox channel.

        Returns True when one arrived.  A broken listening connection is reopened
        on the next call; meanwhile the caller's poll keeps working.  While one is being
        re-opened on another thread (:class:`NotListening`), waits ``timeout_s`` or until
        that attempt ended, and returns False.
        """
        with translated():
            try:
                listen = self._listening()
                # Anything already buffered counts; then wait on the socket.  A peer's
                # notice about shards ends the wait too (without counting as a wake-up):
                # the caller's next turn runs the heartbeat it asks for.
                moved = self._moved
                self._take(listen)
                if self._woken or (self._moved and not moved):
                    return self._woke()
                ready, _, _ = select.select([listen.fileno()], [], [], max(0.0, timeout_s))
                if ready:
                    self._take(listen)
                return self._woke()
            except NotListening as exc:
                if exc.ready is not None:
                    exc.ready.wait(max(0.0, timeout_s))
                else:
                    time.sleep(max(0.0, timeout_s))
                return False
            except (psycopg.OperationalError, psycopg.InterfaceError, OSError):
                self.close()
                time.sleep(min(timeout_s, 0.5))
                return False

    def pause(self, timeout_s: float) -> None:
        """Wait ``timeout_s`` without looking at the LISTEN connection: an awake relay's
        short waits (until its paced claim is due), which no notification needs to end.

        Writers notify only while some relay sleeps (the wake-up lock), never this one's
        own claims while it is awake; what a sleeping peer's writers send, and a peer's
        notice that shards change hands, wait in the socket for the next
        :meth:`shards_moved` (the loop looks every 0.1 s) or :meth:`wait`.  Reading the
        socket and its notifications cost about 55 µs of CPU more than this per paced
        claim at 1,000 events/s."""
        if timeout_s > 0:
            time.sleep(timeout_s)

    def shards_moved(self) -> bool:
        """Without waiting: did a peer say shards change hands since the last call?
        Opens the listening connection if needed, but after a failure to open or read it
        not before a back-off (``REOPEN_BACKOFF_S``, doubling); meanwhile, and on a
        failure, it reads as no notice: the heartbeat's interval still holds.  So does it
        while the connection is re-opened on another thread (:class:`NotListening`)."""
        if (self._conn is None or self._conn.closed) and not self._reopen.due():
            return False
        try:
            self._take(self._listening())
        except NotListening:
            return False
        except (RetriableError, psycopg.OperationalError, psycopg.InterfaceError, OSError):
            self.close()  # could not connect, or the connection broke
            self._reopen.failed()
            return False
        self._reopen.passed()
        moved, self._moved = self._moved, False
        return moved

    def ping(self) -> None:
        """Open the LISTEN connection now (its first statements are the round trip): the
        relay's connections at start (relay/connections.py).  Raises the relay's database
        errors."""
        with translated():
            self._listening()

    @property
    def moved(self) -> bool:
        """A notice that shards change hands was read and not yet taken."""
        return self._moved

    def _take(self, listen: psycopg.Connection[Any]) -> None:
        """Read every notification already arrived, sorted by channel."""
        for note in listen.notifies(timeout=0):
            if note.channel == SHARDS_CHANNEL:
                self._moved = self._moved or note.payload != self._owner
            else:
                self._woken = True

    def _woke(self) -> bool:
        woken, self._woken = self._woken, False
        return woken

    def close(self) -> None:
        """Drop the connection (the session lock goes with it).  Idempotent; the next
        call reconnects."""
        self.sleeping = self.peer_sleeps = self.not_listening = False
        self._woken = self._moved = False
        if self._conn is not None:
            try:
                self._conn.close()
            except psycopg.Error:
                pass
        self._conn = None

    def _listening(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = None
            self._conn = self._open_listening(self._count)
        return self._conn

    def _open_listening(self, count: Callable[[], None]) -> psycopg.Connection[Any]:
        """A new connection, listening: its session statements (:data:`LISTEN_STATEMENTS`)
        have run, ``count`` called before each.  Reads only this object's settings, so any
        thread may call it; closed again if a statement fails."""
        with translated():
            conn = connect(self._dsn, application_name=self._application_name)
            try:
                for name in LISTEN_STATEMENTS:
                    count()
                    conn.execute(query("relay", name))
            except BaseException:
                _close(conn)
                raise
        return conn

    def _adopt(self, conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
        """Take ``conn``, opened on another thread by :meth:`_open_listening` (its
        statements counted now, on the loop's thread)."""
        for _ in LISTEN_STATEMENTS:
            self._count()
        self._conn = conn
        return conn

    def _count(self) -> None:
        self.queries += 1
        self._on_statement()
