"""Named SQL blocks from ``outbox_core/sql/queries/*.sql``, loaded once.

All runtime SQL lives in those files: a block starts with ``-- name: <name>``
and runs to the next one.  Python never builds SQL from strings; dynamic
identifiers go through :mod:`psycopg.sql`.  The loader is :mod:`outbox_core.queries`,
shared with the SDK, so both read the same files the same way.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from outbox_core.queries import load, parse_blocks, query, sql_files

if TYPE_CHECKING:
    from psycopg import sql

__all__ = ["compose", "load", "parse_blocks", "query", "sql_files", "table_identifier"]


def table_identifier(table: str) -> sql.Identifier:
    """``name`` or ``schema.name`` as a quoted identifier (never pasted into SQL)."""
    from psycopg import sql

    parts = table.split(".", 1)
    if not all(parts):
        raise ValueError(f"not a table name: {table!r}")
    return sql.Identifier(*parts)


@functools.lru_cache(maxsize=512)
def compose(group: str, name: str, *, table: str = "outbox") -> str | sql.Composed:
    """A named block with its ``{table}`` placeholder filled in as an identifier (composed
    once per table: the claim runs it hundreds of times a second)."""
    from psycopg import sql

    text = query(group, name)
    if "{table}" not in text:
        return text
    return sql.SQL(text).format(table=table_identifier(table))
