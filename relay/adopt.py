"""Relay an existing Debezium-style outbox table (outbox_core/sql/adopt/debezium.sql).

Writers keep their table and their INSERTs; the relay adds its bookkeeping columns
(with defaults) and reads and marks through a view in the native layout.  Every
name from configuration goes through :class:`psycopg.sql.Identifier`, every value
through :class:`psycopg.sql.Literal`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from relay import adopt_index
from relay.errors import ConfigError, FatalError
from relay.queries import table_identifier

DEFAULT_TOPIC_TEMPLATE = "outbox.event.{aggregatetype}"
#: What ``--existing`` may say about the rows already in the table.
EXISTING = ("published", "pending")
#: Existing rows numbered per transaction (row locks only).
BACKFILL_BATCH = 5000
_FIELD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_COLUMNS = {"id", "aggregatetype", "aggregateid", "type"}


_TOPIC_TEXT = re.compile(r"^[A-Za-z0-9._-]*\Z")


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
    literal = _FIELD.sub("", template)
    if not parts or "{" in literal or "}" in literal:
        raise ConfigError(f"--topic-template {template!r}: use literal text and {{column}} fields")
    if not _TOPIC_TEXT.match(literal):  # "bad topic {type}" routed rows to "bad topic created"
        raise ConfigError(f"--topic-template {template!r}: its text must be of Kafka's topic "
                          "characters, A-Z a-z 0-9 . _ -")
    return sql.SQL(" || ").join(parts)


@dataclass(frozen=True)
class AdoptReport:
    """What ``adopt`` did, and how long each step held which lock (seconds)."""

    already_adopted: bool
    existing: str
    lock_s: float  # ACCESS EXCLUSIVE on the source: catalog changes only
    numbered: int  # existing rows given a relay_seq, under row locks only
    numbering_s: float
    index_s: float  # CREATE INDEX CONCURRENTLY: SHARE UPDATE EXCLUSIVE, writers go on


def adopt(conn: psycopg.Connection[Any], *, source: str, view: str, topic_template: str,
          ce_source: str | None, existing: str = "published", batch: int = BACKFILL_BATCH,
          dsn: str, lock_timeout_s: float, tries: int, index_wait_s: float, log: Any = None) -> AdoptReport:
    """Add the relay's columns, view and trigger (one short transaction under ACCESS
    EXCLUSIVE, no table rewrite), number the existing rows in batches, then build the
    indexes concurrently (the claim's for the server and the shard count, on a connection of
    its own to ``dsn``, its waits bounded by ``index_wait_s``: relay/adopt_index.py).
    Idempotent; ``conn`` must be in autocommit mode.

    ``existing``: ``published`` (Debezium delivered the rows already) or ``pending``
    (relay them, before every new row of their keys, in physical order).
    """
    if existing not in EXISTING:
        raise ConfigError(f"--existing {existing!r}: one of {', '.join(EXISTING)}")
    blocks = adopt_index.blocks()
    bare = source.split(".")[-1]
    sequence = source.rsplit(".", 1)[0] + f".{bare}_relay_seq" if "." in source else f"{bare}_relay_seq"
    #: Each index's block and its name, in the table's schema.
    indexes = {block: f"{bare}_relay_{block.removesuffix('_index')}_idx"
               for block in ("retrying_index", "published_index")}
    names: dict[str, Any] = {
        "source": table_identifier(source),
        "view": table_identifier(view),
        "sequence": table_identifier(sequence),
        "sequence_name": sql.Literal(sequence),
        "seq_column": sql.Identifier(*source.split("."), "relay_seq"),
        "existing_published_at": sql.SQL("now()" if existing == "published" else "NULL"),
        **{block: sql.Identifier(index) for block, index in indexes.items()},
        "topic": topic_expression(topic_template),
        "ce_source": sql.Literal(ce_source),
    }

    def run(name: str) -> None:
        conn.execute(sql.SQL(blocks[name]).format(**names))

    started = time.monotonic()
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
        conn.execute(blocks["lock_timeout"])
        try:
            run("lock_source")
        except psycopg.errors.LockNotAvailable:
            raise FatalError(f"--debezium-table {source}: no ACCESS EXCLUSIVE lock within 5 s "
                             "(a long transaction uses the table); nothing changed, run it again") from None
        started = time.monotonic()  # the lock is held from here to the commit
        adopted = bool(conn.execute(blocks["adopted"], {"source": source}).fetchone() == (True,))
        if not adopted:
            for name in ("create_sequence", "add_columns", "new_row_defaults", "sequence_owner"):
                run(name)
        for name in ("view", "notify_trigger_drop", "notify_trigger"):
            run(name)
    lock_s = time.monotonic() - started

    started = time.monotonic()
    numbered = 0
    after = "(0,0)"
    numbering = sql.SQL(blocks["backfill_seq"]).format(**names)
    while True:
        with conn.transaction():
            done = conn.execute(numbering, {"after": after, "limit": batch,
                                            "sequence": sequence}).fetchone()
        if done is None or done[1] is None:
            break
        numbered += int(done[0])
        after = str(done[1])
    numbering_s = time.monotonic() - started

    started = time.monotonic()
    schema = source.split(".")[:-1]
    for name, index in indexes.items():
        (invalid,) = conn.execute(blocks["invalid_index"], {"source": source, "index": index}).fetchone() or (False,)
        if invalid:  # an earlier run's build that did not finish: built again
            conn.execute(sql.SQL(blocks["drop_invalid_index"]).format(index=sql.Identifier(*schema, index)))
        run(name)  # CONCURRENTLY: outside a transaction
    ((schema, table),) = conn.execute(blocks["adopted_table"], {"source": source}).fetchall()
    adopt_index.ensure(conn, dsn, schema, table, lock_timeout_s=lock_timeout_s, tries=tries,
                       wait_s=index_wait_s, log=log)
    return AdoptReport(already_adopted=adopted, existing=existing, lock_s=lock_s,
                       numbered=numbered, numbering_s=numbering_s,
                       index_s=time.monotonic() - started)
