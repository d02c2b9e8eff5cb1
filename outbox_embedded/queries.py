"""Named SQL blocks of the demo and the bench: ``outbox_embedded/sql/<group>.sql``, found
with importlib.resources (in a wheel and in a checkout alike), in the daemon's block format
(``-- name: <name>``, parsed by ``relay.queries.parse_blocks``)."""

from __future__ import annotations

import functools
from importlib import resources

from relay.queries import parse_blocks

__all__ = ["query"]


@functools.cache
def _load(group: str) -> dict[str, str]:
    return parse_blocks(resources.files("outbox_embedded").joinpath("sql", f"{group}.sql").read_text())


def query(group: str, name: str) -> str:
    """One named block of ``outbox_embedded/sql/<group>.sql``; KeyError names a missing one."""
    try:
        return _load(group)[name]
    except KeyError:
        raise KeyError(f"no query {name!r} in outbox_embedded/sql/{group}.sql") from None
