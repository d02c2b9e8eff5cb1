"""Named SQL blocks from ``sql/queries/*.sql``, loaded once.

All runtime SQL lives in those files: a block starts with ``-- name: <name>``
and runs to the next one.  Python never builds SQL from strings; dynamic
identifiers go through :mod:`psycopg.sql`.  The loader is the SDK's (the relay
may import the SDK; the SDK never imports the relay), so both read the same files
the same way.
"""

from __future__ import annotations

from consumer_sdk._sql import load, parse_blocks, query, sql_dir

__all__ = ["load", "parse_blocks", "query", "sql_dir"]
