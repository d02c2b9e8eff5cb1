"""Named SQL blocks from the package's ``sql/`` folder, found with :mod:`importlib.resources`.

The SQL files live inside this package (``outbox_core/sql/``: ``migrations/``,
``queries/``, ``roles/``, ``adopt/``), so a wheel, an editable install and the
repository find them the same way.  A block starts with ``-- name: <name>`` and runs
to the next one; parameters are psycopg named placeholders.  A line ``-- include: <name>``
in a block stands for the named block of the same file (a fragment several statements
share, such as the relay's fence on its leases: written once, so that no copy of it can
drift from the others).  Neither the relay nor the SDK keeps SQL in Python strings: both
read these files through this module.
"""

from __future__ import annotations

import functools
import re
from importlib.resources import files
from importlib.resources.abc import Traversable

__all__ = ["load", "parse_blocks", "query", "resolve_includes", "sql_files", "strip_comment_lines"]

_NAME = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)
_INCLUDE = re.compile(r"^[ \t]*--\s*include:\s*([a-z_][a-z0-9_]*)[ \t]*$", re.MULTILINE)


def sql_files() -> Traversable:
    """The folder holding ``migrations/``, ``queries/``, ``roles/`` and ``adopt/``."""
    folder = files(__package__ or "outbox_core") / "sql"
    if not (folder / "queries").is_dir():
        raise FileNotFoundError("outbox_core/sql/queries is missing from this installation")
    return folder


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


def resolve_includes(blocks: dict[str, str]) -> dict[str, str]:
    """``blocks`` with each ``-- include: <name>`` line replaced by that block's text
    (itself resolved); an unknown name or a cycle is an error naming the blocks."""
    done: dict[str, str] = {}

    def resolved(name: str, chain: tuple[str, ...]) -> str:
        if name in chain:
            raise ValueError(f"query {chain[0]!r} includes itself: {' -> '.join((*chain, name))}")
        if name not in done:
            def one(match: re.Match[str]) -> str:
                included = match.group(1)
                if included not in blocks:
                    raise ValueError(f"query {name!r} includes {included!r}, which does not exist")
                return resolved(included, (*chain, name))
            done[name] = _INCLUDE.sub(one, blocks[name])
        return done[name]

    return {name: resolved(name, ()) for name in blocks}


def strip_comment_lines(text: str) -> str:
    """``text`` without its whole-line ``--`` comments and blank lines.

    The files keep their comments for readers; the statements sent do not need them.
    psycopg caches the conversion of a statement's placeholders only for statements up
    to 4 KiB, and a claim with its comments was over that: converting it again at every
    claim was about a third of the relay's CPU at a steady 100 events/s."""
    kept = (line.rstrip() for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("--"))
    return "\n".join(kept)


@functools.cache
def load(group: str) -> dict[str, str]:
    """All blocks of ``sql/queries/<group>.sql``, as sent (whole-line comments dropped)."""
    blocks = resolve_includes(parse_blocks((sql_files() / "queries" / f"{group}.sql").read_text(encoding="utf-8")))
    return {name: strip_comment_lines(text) for name, text in blocks.items()}


def query(group: str, name: str) -> str:
    """One named block; ``KeyError`` names the missing query."""
    try:
        return load(group)[name]
    except KeyError:
        raise KeyError(f"no query {name!r} in sql/queries/{group}.sql") from None
