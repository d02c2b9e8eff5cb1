"""Relay an existing Debezium-style outbox table (sql/adopt/debezium.sql).

Writers keep their table and their INSERTs; the relay adds its bookkeeping columns
(with defaults) and reads and marks through a view in the native layout.  Every
name from configuration goes through :class:`psycopg.sql.Identifier`, every value
through :class:`psycopg.sql.Literal`.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg
from psycopg import sql

from relay.errors import ConfigError
from relay.queries import parse_blocks, sql_dir, table_identifier

DEFAULT_TOPIC_TEMPLATE = "outbox.event.{aggregatetype}"
_FIELD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_COLUMNS = {"id", "aggregatetype", "aggregateid", "type"}


def topic_expression(template: str) -> sql.Composable:
    """``outbox.event.{aggregatetype}`` -> ``'outbox.event.' || "aggregatetype"::text``.

    Literal parts become SQL literals, ``{column}`` parts quoted identifiers of the
    Debezium columns; anything else is refused.
    """
    parts: list[sql.Composable] = []
    pos = 0
    for match in _FIELD.finditer(template):
        if match.start() > pos:
            parts.append(sql.Literal(template[pos:match.start()]))
        column = match.group(1)
        if column not in _COLUMNS:
            raise ConfigError(f"--topic-template: {{{column}}} is not one of "
                              f"{', '.join('{' + c + '}' for c in sorted(_COLUMNS))}")
        parts.append(sql.SQL("{}::text").format(sql.Identifier(column)))
        pos = match.end()
    if pos < len(template):
        parts.append(sql.Literal(template[pos:]))
    if not parts or "{" in _FIELD.sub("", template) or "}" in _FIELD.sub("", template):
        raise ConfigError(f"--topic-template {template!r}: use literal text and {{column}} fields")
    return sql.SQL(" || ").join(parts)


def _blocks() -> dict[str, str]:
    return parse_blocks((sql_dir() / "adopt" / "debezium.sql").read_text())


def adopt(conn: psycopg.Connection[Any], *, source: str, view: str, topic_template: str,
          ce_source: str | None) -> None:
    """Add the relay's columns, indexes, trigger and view (one transaction, idempotent)."""
    blocks = _blocks()
    bare = source.split(".")[-1]
    names: dict[str, Any] = {
        "source": table_identifier(source),
        "view": table_identifier(view),
        "pending_index": sql.Identifier(f"{bare}_relay_pending_idx"),
        "retrying_index": sql.Identifier(f"{bare}_relay_retrying_idx"),
        "published_index": sql.Identifier(f"{bare}_relay_published_idx"),
        "topic": topic_expression(topic_template),
        "ce_source": sql.Literal(ce_source),
    }
    with conn.transaction():
        row = conn.execute(blocks["payload_type"], {"source": source}).fetchone()
        if row is None:
            raise ConfigError(f"--debezium-table {source}: no such table with a payload column")
        if row[0] == "jsonb":
            names["payload"], names["payload_bytes"] = sql.SQL("payload"), sql.SQL("NULL::bytea")
        elif row[0] == "bytea":
            names["payload"], names["payload_bytes"] = sql.SQL("NULL::jsonb"), sql.SQL("payload")
        else:  # json, text, varchar: the bytes as written
            names["payload"] = sql.SQL("NULL::jsonb")
            names["payload_bytes"] = sql.SQL("convert_to(payload::text, 'UTF8')")
        for name in ("add_columns", "pending_index", "retrying_index", "published_index", "view",
                     "notify_trigger_drop", "notify_trigger"):
            conn.execute(sql.SQL(blocks[name]).format(**names))
