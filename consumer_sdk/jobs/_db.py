"""The seam between the jobs code and psycopg: named queries, error translation, JSON.

Driver errors become SDK errors here (``raise ... from``): an unreachable
database or a broken connection is :class:`~consumer_sdk.errors.DatabaseUnavailable`,
an aborted transaction :class:`~consumer_sdk.errors.TransactionConflict`, a
missing table :class:`~consumer_sdk.errors.SchemaMissing` (the statement's own: the jobs
schema) or :class:`~consumer_sdk.jobs.errors.TableMissing` (a trigger's or a function's,
raised inside it), a missing column of the statement's own SchemaMissing too (the schema
older than this SDK: ``migrate`` not run since an upgrade), a refused row (a violated
CHECK, a trigger's refusal, a value or size the database cannot store)
:class:`~consumer_sdk.jobs.errors.InvalidJob`, a missing grant
:class:`~consumer_sdk.jobs.errors.PrivilegeMissing`, a read-only database (a standby)
:class:`~consumer_sdk.jobs.errors.DatabaseReadOnly`, a DatabaseUnavailable; a statement a
``statement_timeout`` cancelled :class:`~consumer_sdk.jobs.errors.StatementTimedOut`, a DatabaseUnavailable too.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import psycopg.errors

from consumer_sdk.errors import DatabaseUnavailable, FatalError, SchemaMissing, TransactionConflict
from consumer_sdk.jobs import statement_clock
from consumer_sdk.jobs._check import json_storable
from consumer_sdk.jobs.errors import (
    DatabaseReadOnly,
    InvalidJob,
    PrivilegeMissing,
    StatementTimedOut,  # defined with its siblings; imported from here before
    TableMissing,
)
from outbox_core.queries import query
from outbox_core.text import has_colliding_keys

ConnectionT = psycopg.Connection[Any]


def q(name: str) -> str:
    """A named block of ``sql/queries/jobs.sql``."""
    return query("jobs", name)


def session_q(name: str) -> str:
    """A named block of ``sql/queries/jobs_session.sql`` (the pool's own sessions' settings)."""
    return query("jobs_session", name)


#: The start of a 57014's message when a statement_timeout (not a cancel request) cancelled it,
#: in English: the second sign of a timeout, for the callers' sessions (accept, enqueue) and a
#: caller's ``connect=`` factory's.  The first, on the pool's own sessions, is the clock
#: (:mod:`consumer_sdk.jobs.statement_clock`): a statement_timeout and a cancel request share the
#: SQLSTATE and the reporting routine (only the source line, which moves between versions,
#: differs), and ``lc_messages`` can only be set by a superuser.
_STATEMENT_TIMEOUT = "canceling statement due to statement timeout"


#: SQLSTATE classes of a refusal of what the statement writes (its rows, its values), not of
#: the moment: written again, it is refused again.  Triggered action (09), cardinality (21),
#: data (22: invalid text, out of range...), integrity (23: CHECK, NOT NULL, unique...),
#: triggered data change (27), routine exceptions (2F, 38, 39), WITH CHECK OPTION (44),
#: program limits (54: a jsonb over 256 MB, an index row too large) and PL/pgSQL's own (P0:
#: a trigger's RAISE).  Read as DatabaseUnavailable or FatalError, such a completion was
#: tried again at every round, for ever, or stopped the pool (an audit of the pool).
REFUSED_CLASSES = frozenset({"09", "21", "22", "23", "27", "2F", "38", "39", "44", "54", "P0"})
#: SQLSTATEs outside the connection classes that still pass: the server ended the session
#: (idle_in_transaction_session_timeout, transaction_timeout), not the statement's doing.
PASSING_STATES = frozenset({"25P03", "25P04"})
_GRANTS_HINT = ("grant it to this connection's role (the jobs read and write jobs, runs, job_results, "
                "job_dead_letters and job_activations, execute outbox_jobs_fence(), and insert into the "
                "outbox when they write events)")


def refused(exc: BaseException) -> bool:
    """``exc`` is the database's refusal of the row or value written (see REFUSED_CLASSES)."""
    state = getattr(exc, "sqlstate", None) or ""
    return isinstance(exc, psycopg.Error) and state[:2] in REFUSED_CLASSES


@contextmanager
def translated() -> Iterator[None]:
    """Translate driver errors raised inside the block into SDK errors: what passes (the
    connection, a conflict, a cancel, a lock timeout, a shutdown, a read-only database) is retriable; a refusal of
    the row is :class:`InvalidJob` (the job fails for good); a missing grant is
    :class:`PrivilegeMissing`; anything else a :class:`FatalError`."""
    try:
        yield
    except psycopg.errors.UndefinedTable as exc:
        raise missing_table(exc) from exc
    except psycopg.errors.UndefinedColumn as exc:
        if (exc.diag.context or "").strip():  # inside a trigger or function: not the jobs schema's
            raise FatalError(f"jobs statement failed: {first_line(exc)}, in "
                             f"{(exc.diag.context or '').strip().splitlines()[-1]}") from exc
        raise SchemaMissing(f"the jobs schema is older than this SDK ({first_line(exc)}): run "
                            "`outbox-relay migrate`") from exc
    except psycopg.errors.InsufficientPrivilege as exc:
        raise PrivilegeMissing(f"the database role lacks a privilege: {first_line(exc)}; {_GRANTS_HINT}") from exc
    except psycopg.errors.ReadOnlySqlTransaction as exc:  # 25006: a standby, a failover in progress
        raise DatabaseReadOnly(f"the database is read-only (a standby, or a failover in progress): "
                               f"{first_line(exc)}; waiting for a writable primary") from exc
    except psycopg.Error as exc:
        if (exc.sqlstate or "").startswith("40"):  # serialization failure, deadlock: psycopg's classes
            raise TransactionConflict(f"transaction aborted: {first_line(exc)}") from exc  # are not one
        if refused(exc):
            raise InvalidJob(f"the database refused the row: {first_line(exc)}") from exc
        if isinstance(exc, psycopg.errors.QueryCanceled) and (
                statement_clock.timed_out() or first_line(exc).startswith(_STATEMENT_TIMEOUT)):
            raise StatementTimedOut(f"statement_timeout cancelled the statement ({first_line(exc)}): the pool's "
                                    "own statements run with pool_statement_timeout_s, other sessions with "
                                    "the role's or database's statement_timeout") from exc
        if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)) or exc.sqlstate in PASSING_STATES:
            raise DatabaseUnavailable(f"database unavailable: {first_line(exc)}") from exc
        raise FatalError(f"jobs statement failed: {first_line(exc)}") from exc


def missing_table(exc: psycopg.errors.UndefinedTable) -> SchemaMissing:
    """What a missing table means, with the database's words: raised inside a function (a
    trigger's, most often: PL/pgSQL's context says which) it is that function's table
    (:class:`TableMissing`); else the statement's own, the jobs schema's.  Both said "the
    jobs schema is missing: run migrate" before, even for an audit trigger's dropped table,
    which no migration brings back."""
    where = (exc.diag.context or "").strip().splitlines()
    if where:
        return TableMissing(f"{first_line(exc)}, in {where[-1]}: a trigger or function on the jobs tables uses "
                            "a table that does not exist; create it again or fix the function")
    return SchemaMissing(f"the jobs schema is missing ({first_line(exc)}): run `outbox-relay migrate` (0005_jobs)")


def refusal_cause(exc: BaseException) -> tuple[str, str, str]:
    """What tells one refusal (:class:`InvalidJob` or a missing table, raised by :func:`translated`) from another
    of the same statement: its SQLSTATE, the constraint, and where it was raised (the last
    line of PL/pgSQL's context, the outermost: a trigger's function and line) or else the
    message.  Not the message alone: a trigger's words often name the row (``job 17 ...``)."""
    cause = exc.__cause__ if isinstance(exc.__cause__, psycopg.Error) else None
    if cause is None:
        return "", "", first_line(exc)
    diag = cause.diag
    where = (diag.context or "").strip().splitlines()
    return cause.sqlstate or "", diag.constraint_name or "", where[-1] if where else first_line(cause)


def to_json(value: Any, *, what: str = "value") -> str:
    """Compact JSON text for a jsonb parameter; :class:`InvalidJob` when not encodable or
    not storable (a NUL character, a lone surrogate)."""
    if value is None:  # most handlers return nothing: no encoder for that
        return "null"
    try:
        encoded = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidJob(f"the {what} is not JSON-encodable: {exc}") from None
    except RecursionError:
        raise InvalidJob(f"the {what} is nested too deeply to encode as JSON") from None
    if has_colliding_keys(value):  # as write_event refuses them: jsonb would keep the last only
        raise InvalidJob(f"the {what} has a dict whose keys collide once converted to JSON strings "
                         "(like 1 and '1'): keys must be distinct as strings")
    return json_storable(what, encoded)


def from_json(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
