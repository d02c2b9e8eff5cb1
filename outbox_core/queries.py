"""Named SQL blocks from the ``sql/`` folder (``migrations/``, ``queries/``, ``roles/``, ``adopt/``).

A wheel holds the folder as package data, ``outbox_core/sql`` (found with
:mod:`importlib.resources`); a source checkout or an editable install reads the
repository's top-level ``sql/``.  A block starts with ``-- name: <name>`` and runs to
the next one; parameters are psycopg named placeholders.  Neither the relay nor the
SDK keeps SQL in Python strings: both read these files through this module.
"""

from __future__ import annotations

import functools
import re
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

__all__ = ["load", "parse_blocks", "query", "sql_files"]

_NAME = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


def sql_files() -> Traversable:
    """The folder holding ``migrations/``, ``queries/``, ``roles/`` and ``adopt/``."""
    packaged = files(__package__ or "outbox_core") / "sql"
    checkout = Path(__file__).resolve().parent.parent / "sql"
    for folder in (packaged, checkout):
        if (folder / "queries").is_dir():
            return folder
    raise FileNotFoundError("the sql/ folder is missing from this installation")


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
    return parse_blocks((sql_files() / "queries" / f"{group}.sql").read_text(encoding="utf-8"))


def query(group: str, name: str) -> str:
    """One named block; ``KeyError`` names the missing query."""
    try:
        return load(group)[name]
    except KeyError:
        raise KeyError(f"no query {name!r} in sql/queries/{group}.sql") from None
