"""A worker pool's connections: how they are made, and one lazily (re)connected autocommit
connection owned by one thread of the pool (:class:`ConnSlot`).

Every connection a pool makes carries TCP keep-alives and a ``tcp_user_timeout`` derived
from its lease (:func:`tcp_options`), unless the DSN sets them: without them a statement
sent into a partition that drops packets waited for the kernel's retransmissions (15 tries,
about 15 minutes) and a reply that never came, for ever on an idle connection.  The pool's
factory (:class:`PoolerAware`) keeps track of the connections it made, so that a pool
that stops can shut their sockets down (:meth:`PoolerAware.shut_down`).
"""

from __future__ import annotations

import os
import select
import socket
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.conninfo import make_conninfo
from psycopg.pq import ConnStatus, TransactionStatus

from consumer_sdk import _pg
from consumer_sdk.errors import DatabaseUnavailable
from consumer_sdk.jobs._db import ConnectionT, first_line, q, session_q, translated
from consumer_sdk.jobs.deferred import DeferringConnection, SpinningDeferringConnection
from consumer_sdk.jobs.statement_clock import TimedWaits
from outbox_core.connect_errors import unset_options
from outbox_core.pooling import transaction_pooled

if TYPE_CHECKING:
    from consumer_sdk.jobs.config import WorkerConfig

ConnectionFactory = Callable[[], ConnectionT]


class PoolConnection(TimedWaits, DeferringConnection):
    """A pool's connection: fences sent with the first statement, waits timed (a timeout
    told in any language: :mod:`consumer_sdk.jobs.statement_clock`)."""


class SpinningPoolConnection(TimedWaits, SpinningDeferringConnection):
    """A :class:`PoolConnection` whose waits poll first (``WorkerConfig.db_spin_us``)."""


#: Transaction states with a transaction left open (to roll back).
_OPEN = frozenset({TransactionStatus.INTRANS, TransactionStatus.INERROR})


class PoolerAware:
    """A connection factory that turns psycopg's automatic preparing off on every connection
    it makes once :meth:`probe` found a transaction pooler: psycopg names its prepared
    statements per client connection, and such a pooler shares server sessions between
    clients, so a name could be missing on the next server, or hold another client's
    statement there (:mod:`outbox_core.pooling`).  Called from every thread of the pool."""

    def __init__(self, connect: ConnectionFactory) -> None:
        self._connect = connect
        self.pooled = False
        self._log: Any = None  # set by probe(); until then no probing
        self._probed = False
        self._lock = threading.Lock()
        self._made: weakref.WeakSet[ConnectionT] = weakref.WeakSet()  # every connection made
        self._made_lock = threading.Lock()
        self.closed = False  # by shut_down(): no connection any more

    def __call__(self) -> ConnectionT:
        if self.closed:
            raise DatabaseUnavailable("database unavailable: the worker pool stopped")
        conn = self._connect()
        if not self._probed and self._log is not None:
            self._try_probe()  # the database answers now: the start's probe could not reach it
        if self.pooled:
            conn.prepare_threshold = None
        with self._made_lock:
            self._made.add(conn)
            closed = self.closed
        if closed:  # shut_down() came while it connected
            conn.close()
            raise DatabaseUnavailable("database unavailable: the worker pool stopped")
        return conn

    def shut_down(self, *, sockets: bool) -> int:
        """No connection any more; with ``sockets``, shut down the socket of each connection
        made and still open, so that a thread waiting on one gets an error at once (its own
        thread closes it: closing a connection another thread uses is not safe).  Returns how
        many were shut down."""
        with self._made_lock:
            self.closed = True
            made = list(self._made) if sockets else []
        return sum(shut_socket(conn) for conn in made if not conn.closed)

    def probe(self, log: Any) -> None:
        """At the pool's start.  A database not reachable yet is probed at the first
        connection made after it answers, before that connection is used."""
        self._log = log
        self._try_probe()

    def _try_probe(self) -> None:
        with self._lock:
            if self._probed:
                return
            try:
                self.pooled = transaction_pooled(self._connect)
            except Exception as exc:  # noqa: BLE001 - a diagnosis; the pool's own connections say more
                self._log.warning("pooler_probe_failed", error=first_line(exc),
                                  hint="probed again at the next connection")
                return
            self._probed = True
        if self.pooled:
            self._log.info("transaction_pooler", hint="psycopg's automatic prepared statements are off "
                                                      "for this pool's connections, and the pool sets no "
                                                      "idle_in_transaction_session_timeout nor statement_timeout "
                                                      "(pool_statement_timeout_s; they would stay "
                                                      "on shared server sessions): set the pooler's own, "
                                                      "PgBouncer's idle_transaction_timeout and query_timeout)")


def roll_back_open(conn: ConnectionT) -> bool:
    """Roll back a transaction left open on ``conn``; False when that rollback failed.
    The state is read from libpq (the int: no ConnectionInfo, no enum a job)."""
    if conn.pgconn.transaction_status in _OPEN:
        try:
            conn.rollback()
        except psycopg.Error:
            return False
    return True


def outcome_unknown(exc: BaseException, conn: ConnectionT | None) -> bool:
    """A write that raised ``exc`` on ``conn`` may have committed all the same: the connection
    broke while it waited for the reply (an error the server sent means nothing committed)."""
    return isinstance(exc, DatabaseUnavailable) and (conn is None or conn.closed or conn.broken)


def ended(conn: ConnectionT) -> bool:
    """The server ended this idle connection: its goodbye (or the end of the stream) waits on
    the socket.  No round trip, a poll of the socket.  A database restarted, a failover,
    ``idle_session_timeout``, ``pg_terminate_backend``: kept, the connection failed the next
    job's first statement, whose fenced write then read the broken connection as a lost lease
    (the job left to its lease, its attempt counted, dead-lettered on its last: an audit).

    Only under psycopg's lock of the connection, taken without waiting: another thread may be
    sending a statement on it (the heartbeat's keep-alive of a fenced transaction runs on the
    handler's connection).  Read between that thread's send and its wait, the answer went into
    libpq's buffer, and psycopg, waiting for the socket to turn readable, waited for ever with
    the lock held: every later statement of the executor waited behind it, the job's lease
    renewed all along (a job of the kills bench unfinished after a minute)."""
    if not conn.lock.acquire(blocking=False):
        return conn.broken  # in use by another thread: not idle, not ours to read
    try:
        pgconn = conn.pgconn
        if conn.broken or pgconn.transaction_status != TransactionStatus.IDLE:
            return conn.broken  # a statement in flight or a transaction open: not idle, not ours to read
        for _ in range(3):  # the server's FATAL (read as a notice while idle), then the end of the stream
            if not _readable(pgconn.socket):
                return False
            pgconn.consume_input()  # else a notice, a parameter's new value: kept for psycopg
            if pgconn.status == ConnStatus.BAD:
                return True
    except (psycopg.Error, OSError, ValueError):
        return True
    finally:
        conn.lock.release()
    return False


def _readable(fd: int) -> bool:
    """Data (or the end of the stream) waits on ``fd``, without waiting: poll(), or select()
    where there is none (Windows; select() refuses descriptors past 1023 elsewhere)."""
    if hasattr(select, "poll"):
        poll = select.poll()
        poll.register(fd, select.POLLIN)
        return bool(poll.poll(0))
    return bool(select.select([fd], [], [], 0)[0])


def read_only(conn: ConnectionT) -> bool:
    """The server says the session's transactions are read-only: a hot standby, or
    ``default_transaction_read_only`` on (PostgreSQL 14 and later report both, no round trip:
    elsewhere, and behind a pooler that does not pass them on, False).  Kept, such a session
    failed every write of the pool with 25006 while a new one would reach the new primary."""
    status = conn.pgconn.parameter_status
    return status(b"in_hot_standby") == b"on" or status(b"default_transaction_read_only") == b"on"


def shut_socket(conn: ConnectionT) -> bool:
    """Shut ``conn``'s socket down (both ways), from any thread: a statement its thread waits
    on fails at once ("server closed the connection unexpectedly").  The socket is reached
    through a duplicate of its descriptor, so a descriptor closed and reused meanwhile is
    never the one shut down.  False when there was no socket any more."""
    try:
        duplicate = os.dup(conn.pgconn.socket)
    except (psycopg.Error, OSError):
        return False
    try:
        sock = socket.socket(fileno=duplicate)
    except OSError:
        os.close(duplicate)
        return False
    with sock:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
    return True


def tcp_options(config: WorkerConfig) -> dict[str, int]:
    """libpq's TCP settings for a pool's connections, from its lease and heartbeat.

    A connection idle for a heartbeat interval (whole seconds, at least 1) is probed every
    third of it; data unacknowledged for one lease (``tcp_user_timeout``, which on Linux
    also ends the probing) closes the connection: a statement waiting on a database that
    stopped answering fails about one lease later, when the lease is lost anyway (a
    shorter time would end connections that a lease rides out), at most one lease and a
    third of a heartbeat for a reply that never comes on a quiet connection.  Elsewhere
    (no ``tcp_user_timeout``) three unanswered probes end it."""
    heartbeat_s = config.heartbeat_every_s
    return {"keepalives": 1, "keepalives_idle": max(1, int(heartbeat_s)),
            "keepalives_interval": max(1, int(heartbeat_s / 3)), "keepalives_count": 3,
            "tcp_user_timeout": max(1000, int(config.lease_duration_s * 1000))}


def pool_connect_factory(config: WorkerConfig) -> ConnectionFactory:
    """The connections of a pool run with ``config``: with :func:`tcp_options` where the DSN
    does not set them (its own values win, as its ``connect_timeout`` does:
    :func:`outbox_core.connect_errors.unset_options`); their fenced transactions send BEGIN
    and the fence with the first statement (:mod:`consumer_sdk.jobs.deferred`)."""
    dsn = config.dsn
    extra = unset_options(dsn, tcp_options(config))
    try:
        dsn = make_conninfo(dsn, **extra)
    except psycopg.ProgrammingError:  # not libpq's: connecting says what is wrong with it
        pass
    return _pg.connect_factory(dsn, application_name=config.application_name,
                               spin_s=config.db_spin_us / 1e6,
                               classes=(PoolConnection, SpinningPoolConnection))


def watch_connect(connect: ConnectionFactory, *, statement_ms: int) -> ConnectionFactory:
    """The lock-wait watch's connections, made by the pool's factory ``connect``: named like
    the pool's with ``:watch`` (as the inbox's and the relay's watches), so that pg_stat_activity
    tells them from the pool's working connections, and with the pool's ``statement_timeout``
    (``statement_ms``, 0: none).  Set by a statement, as a factory of the caller's has its own
    name; not behind a transaction pooler (where the watch finds nothing anyway)."""

    def make() -> ConnectionT:
        conn = connect()
        if getattr(connect, "pooled", False):
            return conn
        name = (conn.info.parameter_status("application_name") or "outbox-jobs-worker")[:57] + ":watch"
        try:
            with translated():
                conn.execute(session_q("watch_session_setup"), {"name": name, "statement_ms": statement_ms})
                if not conn.autocommit:
                    conn.commit()  # a session setting made in a transaction rolled back would be undone
        except BaseException:
            conn.close()
            raise
        own_timeout(conn, statement_ms)
        return conn

    return make


def own_timeout(conn: ConnectionT, statement_ms: int) -> None:
    """``conn``'s session runs with the pool's ``statement_timeout`` of ``statement_ms`` (0:
    none): its waits are measured against it (:mod:`consumer_sdk.jobs.statement_clock`)."""
    if isinstance(conn, TimedWaits):
        conn.statement_timeout_s = statement_ms / 1000 if statement_ms > 0 else None


class ConnSlot:
    """A connection that reconnects on demand and is tidied between jobs.

    ``idle_ms`` sets ``idle_in_transaction_session_timeout`` on every new
    connection: a thread frozen inside a transaction (SIGSTOP) is disconnected by
    the server instead of holding its row locks forever.  ``statement_ms`` (the pool's own
    threads' slots only, never an executor's: the handler's session is the handler's) sets
    ``statement_timeout`` too (``pool_statement_timeout_s``; 0 leaves the role's).  Neither
    behind a transaction pooler (a :class:`PoolerAware` factory that found one): the setting
    would stay on whichever server session the pooler lent, for its other clients too.
    """

    def __init__(self, connect: ConnectionFactory, *, idle_ms: int | None = None,
                 statement_ms: int | None = None) -> None:
        self._connect = connect
        self._idle_ms = idle_ms
        self._statement_ms = statement_ms
        self._conn: ConnectionT | None = None
        #: The live connection's session as (backend pid, application_name), None without one:
        #: read by the pool's lock-wait watch (:mod:`.lock_waits`), on its own thread.
        self.session: tuple[int, str] | None = None

    def get(self) -> ConnectionT:
        conn = self._conn
        if conn is not None and not conn.closed and (ended(conn) or read_only(conn)):
            self.close()  # ended while idle; or a standby, a demoted primary: a new session
            conn = None
        if conn is None or conn.closed or conn.broken:
            self.close()
            try:
                conn = self._connect()
            except (psycopg.OperationalError, psycopg.ProgrammingError) as exc:  # a factory of the caller's
                raise _pg.translate_connect_error(exc) from None
            conn.autocommit = True
            if self._idle_ms is not None and not getattr(self._connect, "pooled", False):
                with translated():
                    if self._statement_ms is None:
                        conn.execute(q("session_setup"), {"idle_ms": self._idle_ms})
                    else:
                        conn.execute(session_q("pool_session_setup"),
                                     {"idle_ms": self._idle_ms, "statement_ms": self._statement_ms})
                        own_timeout(conn, self._statement_ms)
            self._conn = conn
            self.session = (conn.info.backend_pid, conn.info.parameter_status("application_name") or "")
        return conn

    def in_use(self) -> bool:
        """A statement is in flight on the connection now (psycopg's lock of it is held), read
        from another thread without waiting (the lock-wait watch asks every few seconds)."""
        conn = self._conn
        if conn is None or not conn.lock.acquire(blocking=False):
            return conn is not None
        conn.lock.release()
        return False

    def tidy(self) -> None:
        """After a job: roll back whatever the handler left open; drop a broken connection."""
        conn = self._conn
        if conn is None:
            return
        if conn.closed or conn.broken:
            self.close()
            return
        if not roll_back_open(conn):
            self.close()

    def close(self) -> None:
        conn, self._conn, self.session = self._conn, None, None
        if conn is not None:
            try:
                conn.close()
            except psycopg.Error:
                pass

    def __enter__(self) -> ConnSlot:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
