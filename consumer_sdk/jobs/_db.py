"""The seam between the jobs code and psycopg: named queries, error translation, JSON.

Driver errors become SDK errors here (``raise ... from``): an unreachable
database or a broken connection is :class:`~consumer_sdk.errors.DatabaseUnavailable`,
an aborted transaction :class:`~consumer_sdk.errors.TransactionConflict`, a
missing table :class:`~consumer_sdk.errors.SchemaMissing`, a violated CHECK
:class:`~consumer_sdk.jobs.errors.InvalidJob`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import psycopg.errors

from consumer_sdk.errors import DatabaseUnavailable, FatalError, SchemaMissing, TransactionConflict
from consumer_sdk.jobs._check import json_storable
from consumer_sdk.jobs.errors import InvalidJob
from outbox_core.queries import query
from outbox_core.text import has_colliding_keys

ConnectionT = psycopg.Connection[Any]


def q(name: str) -> str:
    """A named block of ``sql/queries/jobs.sql``."""
    return query("jobs", name)


@contextmanager
def translated() -> Iterator[None]:
    """Translate driver errors raised inside the block into SDK errors."""
    try:
        yield
    except psycopg.errors.UndefinedTable as exc:
        raise SchemaMissing("the jobs schema is missing: run `outbox-relay migrate` (0005_jobs)") from exc
    except psycopg.errors.TransactionRollback as exc:
        raise TransactionConflict(f"transaction aborted: {first_line(exc)}") from exc
    except (psycopg.errors.IntegrityError, psycopg.errors.ProgramLimitExceeded) as exc:
        # A limit (a jsonb over 256 MB, an index row too large) is the row's, not a passing
        # outage: read as DatabaseUnavailable, its write was tried again for ever.
        raise InvalidJob(f"the database refused the row: {first_line(exc)}") from exc
    except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
        raise DatabaseUnavailable(f"database unavailable: {first_line(exc)}") from exc
    except psycopg.Error as exc:
        raise FatalError(f"jobs statement failed: {first_line(exc)}") from exc


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
