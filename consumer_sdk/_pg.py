"""Opening PostgreSQL connections, errors translated at the seam, and the errors of their round
trips watched (shared by the inbox and the jobs).

:mod:`outbox_core.connect_errors` classifies a failed attempt (for the relay too); the
SDK's reading is ``_CONNECT_ERRORS``: rejected credentials are
:class:`~consumer_sdk.errors.AuthenticationFailed` (fatal: never retried, the service
that embeds the SDK sees it), other refusals :class:`~consumer_sdk.errors.FatalError`,
an unparsable DSN :class:`~consumer_sdk.errors.ConfigError`, the rest (unreachable,
starting up, too many clients) :class:`~consumer_sdk.errors.DatabaseUnavailable`,
retried with back-off.  No message carries a piece of the DSN's password.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import psycopg.errors
from psycopg.pq import TransactionStatus

from consumer_sdk.errors import AuthenticationFailed, ConfigError, DatabaseUnavailable, FatalError
from outbox_core import spin
from outbox_core.connect_errors import ConnectFailure, classify_connect_error, connect_timeout

#: A connection's class, and its class when it polls its socket (:func:`connect`).
Classes = tuple[type[psycopg.Connection[Any]], type[spin.SpinningConnection]]
DEFAULT_CLASSES: Classes = (psycopg.Connection, spin.SpinningConnection)

_CONNECT_ERRORS: dict[ConnectFailure, type[Exception]] = {
    ConnectFailure.UNREACHABLE: DatabaseUnavailable,
    ConnectFailure.CREDENTIALS: AuthenticationFailed,
    ConnectFailure.REFUSED: FatalError,
    ConnectFailure.INVALID_DSN: ConfigError,
}


def translate_connect_error(exc: psycopg.Error, dsn: str = "") -> Exception:
    """The SDK error for a failed connection attempt (see ``_CONNECT_ERRORS``)."""
    failed = classify_connect_error(exc, dsn=dsn)
    return _CONNECT_ERRORS[failed.kind](failed.message)


#: SQLSTATEs outside class 08 that say the server ended the session: admin_shutdown
#: (pg_terminate_backend, a pooler's or a failover's), crash_shutdown (another backend
#: crashed), cannot_connect_now (the server starting or stopping).
SESSION_ENDED = frozenset({"57P01", "57P02", "57P03"})


def connection_failed(exc: psycopg.Error) -> bool:
    """``exc`` says the connection failed, not the statement: class 08, a session the server
    ended (:data:`SESSION_ENDED`), or an OperationalError or InterfaceError without a
    SQLSTATE (the network dropped, the server went away).  One with a SQLSTATE of another
    class (57014 a cancelled statement, 55P03 a lock not available, 53xxx) is the
    statement's.  The inbox store's judgement (consumer_sdk/store_connection.py) and the
    jobs executor's (consumer_sdk/jobs/retry.py ``connection_broke``)."""
    state = exc.sqlstate or ""
    return state.startswith("08") or state in SESSION_ENDED or (
        not state and isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)))


def lost_prepared_statement(exc: BaseException) -> bool:
    """``exc`` says one of psycopg's own prepared statements (``_pg3_...``) was missing, or
    already there, on the server: a transaction pooler without prepared-statement support
    (PgBouncer before 1.21, or later ones with ``max_prepared_statements = 0``) moved the
    session to another server after psycopg prepared a statement it had run five times.
    Not the statement's failure: the caller turns psycopg's automatic preparing off
    (``prepare_threshold = None``) and tries again, with no attempt counted."""
    return isinstance(exc, (psycopg.errors.InvalidSqlStatementName, psycopg.errors.DuplicatePreparedStatement)) \
        and '"_pg3_' in str(exc)


def _watch(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
           ended: Callable[[psycopg.Error | None], None]) -> None:
    """Tell ``ended`` how each round trip on ``conn`` ended (its error, or None).

    A handler that catches a database error and carries on leaves its transaction aborted,
    and psycopg keeps no trace of the error on the connection: only the exception carries
    its SQLSTATE, and COMMIT of an aborted transaction answers ROLLBACK, no error.  The
    inbox store (``StoreConnection.swallowed_error``) and the jobs' fenced transactions read
    :func:`failed_trip`, the one watcher of a connection, to know whether the database
    aborted the transaction (a deadlock, a read-only database) or the handler's own
    statement failed.  The seam is ``conn.wait``, which every statement psycopg runs goes
    through: a cursor's ``execute``, ``executemany``, ``copy`` (its start, writes and end),
    ``stream``, its fetches in pipeline mode, a pipeline's sync and end, a server-side
    cursor's declare, fetches and scrolls, whatever cursor class made them, and the errors
    the wait itself raises (the socket closed).  Watching cursor classes saw only
    ``execute`` and ``executemany``; a pipeline has no factory to set.  The connection's own
    ``wait`` (a subclass's, e.g. a spinning or a timed one) still does the waiting; an
    asyncio connection's is awaited."""
    wait = conn.wait
    watched: Callable[..., Any]
    if isinstance(conn, psycopg.AsyncConnection):
        async def watched(gen: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                done = await wait(gen, *args, **kwargs)
            except psycopg.Error as exc:
                ended(exc)
                raise
            ended(None)
            return done
    else:
        def watched(gen: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                done = wait(gen, *args, **kwargs)
            except psycopg.Error as exc:
                ended(exc)
                raise
            ended(None)
            return done
    conn.wait = watched  # type: ignore[method-assign]


def aborted(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """``conn``'s transaction is aborted: a statement in it failed, and its COMMIT would answer
    ROLLBACK without an error (psycopg's ``commit()`` returns normally).  Read before COMMIT by
    whoever commits a transaction a handler ran statements in (the inbox's processor, the
    jobs' fenced transactions and ``accept``'s hook), and by :class:`FailedTrip`.  From
    ``pgconn``: ``conn.info`` builds an object and an enum at every call."""
    return conn.pgconn.transaction_status == TransactionStatus.INERROR


def consequence(error: psycopg.Error) -> bool:
    """``error`` only follows from an earlier one, which says what went wrong: 25P02, the
    transaction aborted already; ``PipelineAborted``, an earlier statement of the pipeline
    failed (it has no SQLSTATE, and would pass for a lost connection)."""
    return isinstance(error, (psycopg.errors.InFailedSqlTransaction, psycopg.errors.PipelineAborted))


class FailedTrip:
    """The error that aborted a connection's open transaction, as its round trips tell it
    (:func:`_watch`): the last one that failed, not counting those that only follow from it
    (:func:`consequence`); forgotten once a round trip finds the transaction sound again (a
    rollback to a savepoint, a new transaction).  None: none failed, or the error was raised
    without a wait that failed (then :meth:`ended` is told by whoever raised it)."""

    def __init__(self, conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
        self._conn = conn
        self.error: psycopg.Error | None = None

    def ended(self, error: psycopg.Error | None) -> None:
        if error is None:
            # The status only when there is an error to forget (read at every round trip, it
            # cost about a microsecond each: psycopg builds the enum).
            if self.error is not None and not aborted(self._conn):
                self.error = None
        elif not consequence(error):
            self.error = error


def failed_trip(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> FailedTrip:
    """``conn``'s :class:`FailedTrip`, watching it from the first call on: one per connection
    object, however many callers read it (the inbox and a worker pool given the same
    connection share it; each clears ``error`` where its transaction starts)."""
    found: FailedTrip | None = getattr(conn, "_outbox_failed_trip", None)
    if found is None:
        found = FailedTrip(conn)
        conn._outbox_failed_trip = found  # type: ignore[union-attr]
        _watch(conn, found.ended)
    return found


def connect(dsn: str, *, application_name: str, connect_timeout_s: int = 5,
            spin_s: float = 0.0, classes: Classes = DEFAULT_CLASSES) -> psycopg.Connection[Any]:
    """A new autocommit connection to ``dsn``; errors translated (see the module).  With
    ``spin_s`` > 0 its waits for an answer poll the socket that long before sleeping
    (:mod:`outbox_core.spin`).  ``classes``: the connection's class, and its class when it
    polls (the worker pool's: :mod:`consumer_sdk.jobs.deferred`)."""
    try:
        return spin.connect(dsn, spin_s=spin_s, plain=classes[0], spinning=classes[1], autocommit=True,
                            application_name=application_name[:63],
                            **connect_timeout(dsn, connect_timeout_s))
    except (psycopg.OperationalError, psycopg.ProgrammingError) as exc:
        raise translate_connect_error(exc, dsn) from None


def connect_factory(dsn: str, *, application_name: str = "outbox-consumer", connect_timeout_s: int = 5,
                    spin_s: float = 0.0, classes: Classes = DEFAULT_CLASSES) -> Callable[[], psycopg.Connection[Any]]:
    """A factory of :func:`connect`'s connections to ``dsn`` (the inbox's and the worker pool's)."""

    def make() -> psycopg.Connection[Any]:
        return connect(dsn, application_name=application_name, connect_timeout_s=connect_timeout_s,
                       spin_s=spin_s, classes=classes)

    return make


async def connect_async(dsn: str, *, application_name: str,
                        connect_timeout_s: int = 5) -> psycopg.AsyncConnection[Any]:
    """The asyncio twin of :func:`connect`."""
    try:
        return await psycopg.AsyncConnection.connect(dsn, autocommit=True, application_name=application_name[:63],
                                                     **connect_timeout(dsn, connect_timeout_s))
    except (psycopg.OperationalError, psycopg.ProgrammingError) as exc:
        raise translate_connect_error(exc, dsn) from None
