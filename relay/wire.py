"""The claim and the mark as prepared statements of the relay's connection, run with libpq's
own calls below psycopg's cursor.

At a steady rate the relay runs a claim and a mark every few milliseconds, each returning a
handful of rows, and the cursor's work around them cost more client CPU than the
statements' results: a cursor object, the query's placeholder conversion, a dumper picked
for each parameter, psycopg's prepared-statement bookkeeping, the result's column
descriptions.  Measured on this project's machines with nine-row cycles: the claim took
140 µs of the pump thread's CPU through the cursor and 81 µs here, the mark 100 and 49 µs.

:class:`Prepared` keeps one named block of ``relay.sql`` as a server-side prepared
statement (``PREPARE`` once per connection, by libpq's Parse message), sends the values as
text (each is cast by the statement, as every parameter of these blocks is: integers,
booleans, array literals from :func:`relay.db.int_array`, snapshots, timestamps), and
loads the binary result with psycopg's own row loaders (``psycopg.adapt.Transformer``).
No SQL is built from values: the statement's text is the block's, with ``{table}``
composed as an identifier before it is prepared.

A statement can vanish from a connection: psycopg sends ``DEALLOCATE ALL`` after a
rollback or a DROP on it (its own prepared statements would be stale), and a session
pooler may hand the relay a server that never saw the PREPARE.  The server then answers
``invalid_sql_statement_name`` (SQLSTATE 26000) before running anything, so the statement
is prepared again and sent once more.

:data:`INTERNALS` is false on a psycopg release without the internals this uses; the
store then keeps its cursor path (tests/unit/test_relay_wire.py fails, so that is seen).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import psycopg
import psycopg.errors
from psycopg import abc, generators, pq
from psycopg.adapt import Transformer

from relay.queries import compose

#: The psycopg internals this module uses (tested with psycopg 3.3).
INTERNALS = (hasattr(generators, "execute") and hasattr(psycopg.Connection, "wait")
             and hasattr(Transformer, "load_rows") and hasattr(Transformer, "set_pgresult"))

_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%")
_BINARY = pq.Format.BINARY
_ROWS = (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK)


def positional(text: str) -> tuple[str, list[str]]:
    """``text`` with psycopg's named placeholders (``%(name)s``, ``%%``) as PostgreSQL's
    positional ones; returns it and the parameters' names in position order."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "%"
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    return _PLACEHOLDER.sub(number, text), names


def text_value(value: Any) -> bytes | None:
    """A parameter in PostgreSQL's text format (the statement casts it)."""
    if value is None:
        return None
    if value is True or value is False:
        return b"t" if value else b"f"
    if isinstance(value, datetime):
        return value.isoformat().encode()
    if isinstance(value, (int, str)):
        return str(value).encode()
    raise TypeError(f"no text form for a parameter of type {type(value).__name__}")


class Prepared:
    """One named block of ``relay.sql`` as a prepared statement; see the module's docstring.

    Owned by one store (one thread), like its connection."""

    def __init__(self, group: str, name: str, *, table: str) -> None:
        self.group, self.query, self.table = group, name, table
        self.name = b""  # outbox_relay_<block>_<checksum of its text>, set when prepared
        self._conn: psycopg.Connection[Any] | None = None  # where it is prepared
        self._names: list[str] = []
        self._loader: abc.Transformer | None = None

    def run(self, conn: psycopg.Connection[Any], params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """The statement's rows (binary format, loaded as psycopg loads them), as tuples.
        Errors are raised as psycopg errors."""
        if conn is not self._conn:
            self._prepare(conn)
        values = [text_value(params[name]) for name in self._names]
        try:
            result = self._execute(conn, values)
        except psycopg.errors.InvalidSqlStatementName:  # deallocated since: nothing ran
            self._prepare(conn)
            result = self._execute(conn, values)
        loader = self._loader
        assert loader is not None
        loader.set_pgresult(result)
        return loader.load_rows(0, result.ntuples, tuple)

    def _prepare(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = None
        composed = compose(self.group, self.query, table=self.table)
        text, self._names = positional(composed if isinstance(composed, str) else composed.as_string(conn))
        self.name = f"outbox_relay_{self.query}_{zlib.crc32(text.encode()):08x}".encode()
        pgconn = conn.pgconn
        with conn.lock:
            pgconn.send_prepare(self.name, text.encode())
            results = conn.wait(generators.execute(pgconn))
        failed = [r for r in results if r.status not in _ROWS]
        if failed and not _already_prepared(failed[0]):
            raise psycopg.errors.error_from_result(failed[0], encoding=conn.info.encoding)
        self._loader = Transformer(conn)
        self._conn = conn

    def _execute(self, conn: psycopg.Connection[Any], values: list[bytes | None]) -> pq.abc.PGresult:
        pgconn = conn.pgconn
        with conn.lock:
            pgconn.send_query_prepared(self.name, values, result_format=_BINARY)
            results = conn.wait(generators.execute(pgconn))
        for result in results:
            if result.status not in _ROWS:
                raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
        last: pq.abc.PGresult = results[-1]
        return last


def _already_prepared(result: pq.abc.PGresult) -> bool:
    """A PREPARE that failed because the name is taken: the connection has it already (the
    same text: the name carries its checksum)."""
    return result.error_field(pq.DiagnosticField.SQLSTATE) == b"42P05"
