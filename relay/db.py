"""PostgreSQL connections, and the driver's errors translated at the seam.

Driver errors are translated here into :mod:`relay.errors` types: a server that cannot be
reached is :class:`DatabaseUnavailable` (waited for), and so is a read-only one
(SQLSTATE 25006: a hot standby, or a failover in progress: :class:`DatabaseReadOnly`);
a server that refuses us for good (bad credentials, no such database or role) is fatal.
The store (relay/store.py), the wake-up connection, the waits and the one-shot commands
connect through :func:`connect` and run their statements inside :func:`translated`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import psycopg.errors
from psycopg.abc import Buffer
from psycopg.types.datetime import TimestamptzLoader

from outbox_core.connect_errors import ConnectFailure, classify_connect_error, connect_timeout
from outbox_core.pooling import transaction_pooled
from relay.config import DSN_OPTION, mask_text
from relay.errors import (
    AuthenticationFailed,
    ConfigError,
    DatabaseReadOnly,
    DatabaseUnavailable,
    FatalError,
    PermissionDenied,
    SchemaBehind,
    SchemaMissing,
    StatementCancelled,
    TransactionPoolerUnsupported,
)

# The relay's reading of a failed connection attempt (outbox_core.connect_errors classifies it,
# for the SDK too): only an unreachable database is waited for; rejected credentials end the
# process with exit code 4 (the DSN is read once, so retrying would resend the same password);
# an invalid DSN is a ConfigError naming its option (:func:`translate_connect_error`).
_CONNECT_ERRORS: dict[ConnectFailure, type[Exception]] = {
    ConnectFailure.UNREACHABLE: DatabaseUnavailable,
    ConnectFailure.CREDENTIALS: AuthenticationFailed,
    ConnectFailure.REFUSED: FatalError,
}


def translate_connect_error(exc: psycopg.Error, dsn: str = "", *, option: str = DSN_OPTION) -> Exception:
    """The relay's error for a failed connection attempt (see ``_CONNECT_ERRORS``); a DSN
    libpq refuses, at parse or connect time, is named by ``option``, as the checks at start
    name it (relay/config.py): "invalid PostgreSQL connection string: connection is bad:
    ..." did not say where the string came from."""
    failed = classify_connect_error(exc, dsn=dsn)
    if failed.kind is ConnectFailure.INVALID_DSN:
        return ConfigError(f"{option} is not a valid PostgreSQL connection string: {failed.detail}")
    return _CONNECT_ERRORS[failed.kind](failed.message)


def connect(dsn: str, *, application_name: str = "outbox-relay", autocommit: bool = True,
            connect_timeout_s: int = 5, option: str = DSN_OPTION, prepare: bool = True) -> psycopg.Connection[Any]:
    """A new connection, errors translated (``option``: what gave the DSN).  ``prepare=False``:
    psycopg never prepares a statement on it (its default prepares one executed 5 times), for
    a command that works through a transaction pooler, where a prepared statement stays on
    the server connection it was made on while the next transaction may get another."""
    try:
        conn = psycopg.connect(dsn, autocommit=autocommit, application_name=application_name,
                               **connect_timeout(dsn, connect_timeout_s))
    except (psycopg.OperationalError, psycopg.ProgrammingError) as exc:
        raise translate_connect_error(exc, dsn, option=option) from None
    conn.adapters.register_loader("timestamptz", _TimestamptzOrInfinity)
    if not prepare:
        conn.prepare_threshold = None
    return conn


class _TimestamptzOrInfinity(TimestamptzLoader):
    """``infinity`` and ``-infinity`` as that text: Python's datetime has neither, and a row
    with such a created_at (the schema allows it) made `dead-letters list` and `show` fail
    with a traceback, hiding every dead letter (an audit with hostile rows)."""

    def load(self, data: Buffer) -> Any:
        if data in (b"infinity", b"-infinity"):
            return bytes(data).decode()
        return super().load(data)


def require_schema(check: dict[str, Any], table: str) -> None:
    """Raise what ``schema_check`` found wrong, said so a person can act: the relay's own
    tables there but not the outbox names a ``--table`` that is not there, or one that is
    not an outbox (migrating would help neither)."""
    if not (check["has_shards"] and check["has_settings"]):
        raise SchemaMissing()
    if not check["has_outbox"]:
        raise SchemaMissing(f"no table or view {table!r} (--table / OUTBOX_RELAY_TABLE): name the "
                            "outbox table, or the view `migrate --debezium-table` made")
    if check["missing_columns"]:
        raise ConfigError(f"{table!r} (--table / OUTBOX_RELAY_TABLE) is not an outbox: it has no "
                          f"column {', '.join(check['missing_columns'])}")


@contextmanager
def translated(*, schema_behind: bool = False) -> Iterator[None]:
    """Translate driver errors raised inside the block; with ``schema_behind`` (the relay's
    own statements, not a migration's), a missing column or function is a schema older
    than the relay."""
    try:
        yield
    except psycopg.errors.UndefinedTable as exc:
        raise SchemaMissing(
            f"the outbox schema is missing ({exc.diag.message_primary}): run `outbox-relay migrate`"
        ) from None
    except (psycopg.errors.UndefinedColumn, psycopg.errors.UndefinedFunction) as exc:
        if not schema_behind:
            raise
        # A schema older than the relay (a migration not applied): a traceback and exit 1
        # before, after relay_started (an audit of the relay's operation).
        raise SchemaBehind(f"the schema is older than this relay ({exc.diag.message_primary}): "
                           "run `outbox-relay migrate`") from None
    except psycopg.errors.InsufficientPrivilege as exc:
        raise PermissionDenied(f"permission denied: {exc.diag.message_primary}") from None
    except psycopg.errors.ReadOnlySqlTransaction as exc:
        # A standby, or a primary being failed over: wait for a writable one like for an
        # unreachable database.  The caller drops the connection, so the next attempt
        # reconnects (a multi-host DSN with target_session_attrs=read-write finds the new primary).
        raise DatabaseReadOnly(f"the database is read-only (standby or failover): "
                               f"{exc.diag.message_primary}") from None
    except psycopg.errors.QueryCanceled as exc:
        raise StatementCancelled(f"statement cancelled: {mask_text(str(exc).strip())}") from exc
    except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
        raise DatabaseUnavailable(f"database connection lost: {mask_text(str(exc).strip())}") from exc


def int_array(values: Iterable[int]) -> str:
    """Integers as a PostgreSQL array literal (``{1,2,3}``), for a parameter the query
    casts (``%(ids)s::bigint[]``).  psycopg dumps a Python list element by element, in
    Python, after a pass to pick the element type: for a mark of a few rows that was
    half the mark's client CPU (175 against 90 µs, measured).  A value, never SQL text:
    anything but integers fails the server's cast."""
    return "{" + ",".join(map(str, values)) + "}"


def check_not_transaction_pooled(dsn: str, *, application_name: str = "outbox-relay-probe") -> None:
    """Raise :class:`TransactionPoolerUnsupported` when ``dsn`` reaches PostgreSQL through a
    transaction pooler (:func:`outbox_core.pooling.transaction_pooled`).

    The relay keeps session state on purpose: LISTEN, the session advisory lock of the
    wake-up protocol (sql/migrations/0003_notify.sql) and ``synchronous_commit = off``
    for its own writes.  Behind a transaction pooler those would land on whatever
    server process a transaction borrowed: notifications lost, the wake-up lock
    stranded (every writer then pays for NOTIFY), and the application's sessions
    committing without waiting for the WAL.  So the relay refuses to run there.
    """
    with translated():
        pooled = transaction_pooled(lambda: connect(dsn, application_name=application_name))
    if pooled:
        raise TransactionPoolerUnsupported()

