"""Named SQL blocks of the SDK, loaded once from the project's ``sql/`` folder.

A block starts with ``-- name: <name>`` and runs to the next one; parameters are
psycopg named placeholders.  The SDK keeps no SQL in Python strings, and never
imports the ``relay`` package: it reads the same files on its own.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

_NAME = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


def sql_dir() -> Path:
    """The folder holding ``migrations/`` and ``queries/``.

    In a wheel it is ``consumer_sdk/sql_files``; in a source checkout it is the
    top-level ``sql/`` folder.
    """
    here = Path(__file__).resolve().parent
    for candidate in (here / "sql_files", here.parent / "sql"):
        if (candidate / "queries").is_dir():
            return candidate
    raise FileNotFoundError("the SDK's sql/ folder is missing from this installation")


def parse_blocks(text: str) -> dict[str, str]:
    """Split a file into ``{name: sql}``; a duplicate name is an error."""
    blocks: dict[str, str] = {}
    matches = list(_NAME.finditer(text))
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        name = match.group(1)
        if name in blocks:
            raise ValueError(f"duplicate query name {name!r}")
        blocks[name] = text[match.end() : end].strip()
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
