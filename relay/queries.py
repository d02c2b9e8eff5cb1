"""Named SQL blocks from ``sql/queries/*.sql``, loaded once.

All runtime SQL lives in those files: a block starts with ``-- name: <name>``
and runs to the next one.  Python never builds SQL from strings; dynamic
identifiers go through :mod:`psycopg.sql`.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

_NAME = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


def sql_dir() -> Path:
    """The folder holding ``migrations/`` and ``queries/``.

    In a wheel it is packaged as ``relay/_sql``; in a source checkout it is the
    top-level ``sql/`` folder.
    """
    here = Path(__file__).resolve().parent
    for candidate in (here / "_sql", here.parent / "sql"):
        if (candidate / "migrations").is_dir():
            return candidate
    raise FileNotFoundError("the relay's sql/ folder is missing from this installation")


def parse_blocks(text: str) -> dict[str, str]:
    """Split a file into ``{name: sql}``; comments before a block's SQL are kept."""
    blocks: dict[str, str] = {}
    matches = list(_NAME.finditer(text))
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        body = text[match.end() : end].strip()
        if match.group(1) in blocks:
            raise ValueError(f"duplicate query name {match.group(1)!r}")
        blocks[match.group(1)] = body
    return blocks


@functools.cache
def load(group: str) -> dict[str, str]:
    """All blocks of ``sql/queries/<group>.sql``."""
    return parse_blocks((sql_dir() / "queries" / f"{group}.sql").read_text())


def query(group: str, name: str) -> str:
    """One named block; ``KeyError`` names the missing query."""
    try:
        return load(group)[name]
    except KeyError:
        raise KeyError(f"no query {name!r} in sql/queries/{group}.sql") from None
