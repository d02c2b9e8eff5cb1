"""Opening PostgreSQL connections, errors translated at the seam (shared by the inbox and the jobs).

libpq gives no SQLSTATE for connection failures, so the classification reads the
server's FATAL message here, once: rejected credentials are
:class:`~consumer_sdk.errors.AuthenticationFailed` (fatal: never retried), other
refusals :class:`~consumer_sdk.errors.FatalError`, the rest (unreachable, starting
up, too many clients) :class:`~consumer_sdk.errors.DatabaseUnavailable`.  No
message carries a piece of the DSN's password.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg

from consumer_sdk.errors import AuthenticationFailed, ConfigError, DatabaseUnavailable, FatalError
from consumer_sdk.secrets import scrub

_TRANSIENT_FATAL = re.compile(
    r"starting up|shutting down|in recovery|recovery mode|not yet accepting connections|"
    r"too many (connections|clients)|remaining connection slots|"
    r"terminating connection|administrator command|cannot connect now", re.IGNORECASE)
_AUTH = re.compile(r"password authentication failed|authentication failed|no pg_hba.conf entry|"
                   r"password is required|role \".*\" does not exist", re.IGNORECASE)


def translate_connect_error(exc: psycopg.Error, dsn: str = "") -> Exception:
    """The SDK error for a failed connection attempt."""
    text = str(exc).strip()
    if isinstance(exc, psycopg.ProgrammingError):  # libpq could not parse the DSN
        return ConfigError(f"invalid PostgreSQL connection string: {scrub(text, dsn=dsn)}".splitlines()[0])
    if "FATAL:" in text and not _TRANSIENT_FATAL.search(text):
        detail = text.split("FATAL:", 1)[1].strip().splitlines()[0]
        if _AUTH.search(detail):
            return AuthenticationFailed(f"the database rejected the credentials: {scrub(detail, dsn=dsn)}")
        return FatalError(f"the database refused the connection: {scrub(detail, dsn=dsn)}")
    first = text.splitlines()[0] if text else type(exc).__name__
    return DatabaseUnavailable(f"database unreachable: {scrub(first, dsn=dsn)}")


def connect(dsn: str, *, application_name: str, connect_timeout_s: int = 5) -> psycopg.Connection[Any]:
    """A new autocommit connection to ``dsn``; errors translated (see the module)."""
    try:
        return psycopg.connect(dsn, autocommit=True, application_name=application_name[:63],
                               connect_timeout=connect_timeout_s)
    except (psycopg.OperationalError, psycopg.ProgrammingError) as exc:
        raise translate_connect_error(exc, dsn) from None


async def connect_async(dsn: str, *, application_name: str,
                        connect_timeout_s: int = 5) -> psycopg.AsyncConnection[Any]:
    """The asyncio twin of :func:`connect`."""
    try:
        return await psycopg.AsyncConnection.connect(dsn, autocommit=True, application_name=application_name[:63],
                                                     connect_timeout=connect_timeout_s)
    except (psycopg.OperationalError, psycopg.ProgrammingError) as exc:
        raise translate_connect_error(exc, dsn) from None
