"""Opening PostgreSQL connections, errors translated at the seam (shared by the inbox and the jobs).

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
