"""The relay's exception hierarchy.

Retryability lives in the type, never in a string match: the loop retries
:class:`RetriableError` with back-off and turns :class:`FatalError` into one
clear line on stderr and a non-zero exit code.  Each class's docstring is its
default message.
"""

from __future__ import annotations


class RelayError(Exception):
    """The outbox relay failed."""

    #: Process exit code when this error ends the process.
    exit_code = 1

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip().splitlines()[0])


class FatalError(RelayError):
    """A problem a person has to fix; retrying will not help."""


class ConfigError(FatalError):
    """Invalid configuration."""

    exit_code = 2


class NotFound(FatalError):
    """Nothing matches what was asked for (a dead letter's event id, a replay's id)."""


class SchemaMissing(FatalError):
    """The outbox schema is missing: run `outbox-relay migrate` first."""

    exit_code = 3


class SchemaBehind(SchemaMissing):
    """The schema lacks a column or function this relay uses: a migration it needs is not applied."""


class PermissionDenied(FatalError):
    """The database role lacks a privilege this operation needs."""


class AuthenticationFailed(FatalError):
    """The database rejected the credentials."""

    exit_code = 4


class TransactionPoolerUnsupported(FatalError):
    """The relay is connected through a transaction pooler (PgBouncer pool_mode=transaction):
    connect it directly to PostgreSQL, or through a session-mode pool."""

    exit_code = 5


class RetriableError(RelayError):
    """A passing problem; the operation is retried with back-off."""


class DatabaseUnavailable(RetriableError):
    """The database cannot be reached right now."""


class StatementCancelled(DatabaseUnavailable):
    """The server cancelled a statement (a statement_timeout on the role, an operator's
    pg_cancel_backend): the connection is fine, the statement was too slow for it."""


class DatabaseReadOnly(DatabaseUnavailable):
    """The database is read-only (a standby, or a primary during failover); waiting for a writable one."""


class LeaseLost(RelayError):
    """This replica no longer holds the lease it wrote under (its token is stale).

    Raised by the exactly-once mode's recovery when its fenced mark finds the shard taken over;
    the shard worker reports it as fenced.  (An unreachable broker is no exception: the
    producer's error callback reports it as a :class:`relay.publisher.BrokerState`.)"""
